"""An inference job's model and its loops: the trained weights placed by the strategy (or by device_map=auto),
never with an optimizer; the prompts' batches shared among data-parallel ranks and generated, the completions
gathered back in input order."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

from runner.components.mixed_precision import autocast
from runner.components.modeling import build_tokenizer
from runner.config.task import DeviceMap, InferenceTaskConfig, TrainedModel, trained_model
from runner.engine.loss import with_summed_loss
from runner.engine.metrics import ProgressBar
from runner.engine.placement import device_of, placed_model
from runner.files.tensor_io import read_model_shards
from runner.generation.decoding import Batch, Decoding, up_to_eos

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from runner.config.spec import RunSpec
    from runner.distributed import Ranks

log = logging.getLogger("runner")


@dataclass
class InferenceModel:
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device  # where its inputs go
    autocast: Callable[[], ContextManager]
    placement: list[str] = field(default_factory=list)  # device_map's lines: which layers went where
    # The run directory's offload folder, which device_map filled for this job alone.
    own_offload_dir: Optional[Path] = None

    def release(self) -> None:
        """Removes the weights this job offloaded to its own folder."""
        if self.own_offload_dir is not None:
            shutil.rmtree(self.own_offload_dir, ignore_errors=True)


def inference_model(
    spec: RunSpec, task: InferenceTaskConfig, ranks: Ranks, run_dir: Path, on_cpu: bool = False
) -> InferenceModel:
    """The trained model in eval mode, placed by device_map=auto, or else as the strategy places inference: a
    whole replica on this rank's device (on the CPU with `on_cpu`), or sharded."""
    import torch

    compute_device = device_of(spec, ranks)
    device = torch.device("cpu") if on_cpu else compute_device
    tokenizer = build_tokenizer(spec.model)
    trained = trained_model(task.trained) if task.trained else TrainedModel()

    def cast_forward() -> ContextManager:
        return autocast(spec.precision, compute_device, compute_dtype=spec.strategy.forward_cast is None)

    if task.device_map is DeviceMap.auto:
        from runner.generation.big_model import place_for_inference, placement_lines
        from runner.memory.device_map import memory_limits

        hardware = spec.hardware
        # One process places the model over every GPU it sees, as accelerate does.
        gpus = torch.cuda.device_count() if hardware.accelerator.value == "cuda" else 0
        limits = memory_limits(hardware.device_memory_gib, gpus, hardware.host_memory_gib, task.max_memory)
        offload_dir = Path(task.offload_dir) if task.offload_dir else run_dir / "offload"
        own_offload_dir = None if task.offload_dir else offload_dir
        try:
            model, device_map = place_for_inference(
                spec.model, tokenizer, limits, offload_dir, dtype=spec.precision.param_dtype.torch, seed=spec.seed
            )
        except BaseException:  # a failure or Ctrl-C while the weights go to disk: leave no half-written folder
            if own_offload_dir is not None:
                shutil.rmtree(own_offload_dir, ignore_errors=True)
            raise
        model.eval().requires_grad_(False)
        with_summed_loss(model, spec.train.loss, spec.train.loss_chunk_tokens)
        first = next(iter(device_map.values()))
        input_device = torch.device("cuda", first) if isinstance(first, int) else torch.device("cpu")
        return InferenceModel(
            model,
            tokenizer,
            input_device,
            cast_forward,
            placement_lines(model, device_map, offload_dir, limits),
            own_offload_dir,
        )
    # A checkpoint's whole weights are loaded as the model is built; its shards (SHARDED) into the model as placed.
    shards = trained.checkpoint / "model" if trained.checkpoint is not None else None
    weights = None
    if trained.checkpoint is not None and not shards.is_dir():
        from safetensors.torch import load_file

        weights = load_file(trained.checkpoint / "model.safetensors")
    model = placed_model(spec, ranks, device, tokenizer, training=False, weights=weights).model
    if shards is not None and shards.is_dir():
        read_model_shards(model, shards)
    # Frozen: autocast would otherwise keep a low-precision copy of every weight that requires grad.
    model.eval().requires_grad_(False)
    return InferenceModel(model, tokenizer, device, cast_forward)


def my_batches(count: int, ranks: Ranks) -> list[int]:
    """The batches this rank generates: every world_size-th, so that each batch is the one a single process makes."""
    return list(range(ranks.rank, count, ranks.world_size))


def generate(
    model: InferenceModel, batches: list[Batch], mine: list[int], decoding: Decoding, seed: int, progress: bool
) -> dict[int, list[list[int]]]:
    """The new tokens of each row of this rank's batches, by batch index, through transformers' generate. A
    sampled batch draws from its own seed (seed + its index): the same whatever rank it falls to."""
    import torch

    from runner.strategies.strategy_protocol import unwrapped

    generator_model = unwrapped(model.model)
    bar = ProgressBar(progress, 0, sum(len(batches[b]["input_ids"]) for b in mine), unit="prompt")
    new_tokens: dict[int, list[list[int]]] = {}
    started, generated = time.perf_counter(), 0
    for index in mine:
        batch = {k: v.to(model.device) for k, v in batches[index].items()}
        torch.manual_seed(seed + index)
        with torch.no_grad(), model.autocast():
            output = generator_model.generate(
                **batch,
                max_new_tokens=decoding.max_new_tokens,
                do_sample=decoding.do_sample,
                temperature=decoding.temperature,
                top_p=decoding.top_p,
                top_k=decoding.top_k,
                pad_token_id=decoding.pad_token_id,
                eos_token_id=decoding.eos_token_id,
            )
        rows = output[:, batch["input_ids"].shape[1] :].tolist()
        new_tokens[index] = rows
        generated += sum(len(up_to_eos(row, decoding.eos_token_id)) for row in rows)
        seconds = time.perf_counter() - started
        bar.advance(len(rows), prompts_per_s=f"{bar.done / seconds:.2f}", tokens_per_s=f"{generated / seconds:,.0f}")
        log.info(
            "generated batch %d of %d | %d prompts | %.2f prompts/s | %s tokens/s",
            index + 1,
            len(batches),
            len(rows),
            bar.done / seconds,
            f"{generated / seconds:,.0f}",
        )
    bar.close()
    return new_tokens


def gathered(new_tokens: dict[int, list[list[int]]]) -> dict[int, list[list[int]]]:
    """Every rank's batches, on every rank."""
    import torch.distributed as dist

    from runner.distributed import process_group_up

    if not process_group_up():
        return new_tokens
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, new_tokens)
    return {index: rows for part in parts for index, rows in part.items()}
