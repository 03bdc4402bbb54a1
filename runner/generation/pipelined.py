"""Pipeline-parallel generation: a causal LM's decoder layers cut into contiguous stages, one stage per rank, run
by torch.distributed.pipelining.

A batch is decoded in a buffer of fixed shape [rows, prompt + max_new_tokens]: the left-padded prompt, the tokens
generated so far, and filler after them. Each step sends the whole buffer through the pipeline (no KV cache; causal
attention keeps the filler from reaching the positions before it), cut into microbatches along the rows so that the
stages work at once. The last stage picks every row's next token from the logits at the current position and
broadcasts them; every rank writes them into its own buffer, so all ranks agree on the tokens and on when to stop.
Fixed shapes let one PipelineStage and schedule serve every step of a batch, with its activation shapes given up
front rather than inferred by a trial forward pass.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from runner.distributed import Ranks
from runner.generation.decoding import Batch, Decoding, next_tokens, up_to_eos
from runner.parallel.pipeline.stages import decoder_of, run_layers


class DecoderStage(nn.Module):
    """One stage of a Llama-family causal LM. The first stage takes (input_ids, attention_mask), the others
    (hidden_states, attention_mask); every stage but the last returns (hidden_states, attention_mask), the last
    returns the logits [rows, vocab] at `logits_position`, the position whose next token is being chosen."""

    def __init__(
        self,
        config,
        embed_tokens: Optional[nn.Module],
        layers: nn.ModuleList,
        rotary_emb: nn.Module,
        norm: Optional[nn.Module],
        lm_head: Optional[nn.Module],
    ):
        super().__init__()
        self.config = config
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.rotary_emb = rotary_emb
        self.norm = norm
        self.lm_head = lm_head
        self.logits_position = -1

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor):
        hidden = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        hidden = run_layers(
            self.config,
            list(self.layers),
            self.rotary_emb,
            hidden,
            attention_mask,
            generation_position_ids(attention_mask),
        )
        if self.lm_head is None:
            return hidden, attention_mask
        return self.lm_head(self.norm(hidden[:, self.logits_position]))


def generation_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' generate derives them from a left-padded mask: each real token's count of real
    tokens before it, and 0 on the padding."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 0)


def stage_module(model: nn.Module, stage: int, bounds: list[tuple[int, int]]) -> nn.Module:
    """This stage's part of a Llama-family transformers causal LM (model.model.embed_tokens, .layers, .norm,
    .rotary_emb and model.lm_head). The model is consumed: the parts of the other stages are removed from it, so
    that once it is dropped this rank holds only its own stage's weights."""
    decoder = decoder_of(model, "pipeline generation")
    first, end = bounds[stage]
    is_first, is_last = stage == 0, stage == len(bounds) - 1
    module = DecoderStage(
        model.config,
        embed_tokens=decoder.embed_tokens if is_first else None,
        layers=nn.ModuleList(decoder.layers[first:end]),
        rotary_emb=decoder.rotary_emb,
        norm=decoder.norm if is_last else None,
        lm_head=model.lm_head if is_last else None,
    )
    decoder.layers = nn.ModuleList()
    decoder.embed_tokens = None
    decoder.norm = None
    model.lm_head = None
    return module


def pipeline_generate(
    model: nn.Module,
    batches: list[Batch],
    decoding: Decoding,
    ranks: Ranks,
    bounds: list[tuple[int, int]],
    microbatches: int,
    seed: int,
    device: torch.device,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> list[list[int]]:
    """The new token ids of every row of every batch, in order, on every rank: rank r runs stage r of `bounds` in
    the initialised process group, on `device`, its forward in `autocast`. Each row's tokens end after its
    eos_token_id, or at max_new_tokens. `model` is consumed (see stage_module). Sampling draws from a generator
    seeded with seed + the batch's index."""
    module = stage_module(model, ranks.rank, bounds).to(device).eval()
    new_tokens = []
    with torch.no_grad(), autocast():
        for index, batch in enumerate(batches):
            generator = None
            if decoding.do_sample and ranks.rank == len(bounds) - 1:
                generator = torch.Generator(device=device).manual_seed(seed + index)
            new_tokens.extend(
                generate_batch(module, batch, decoding, ranks, len(bounds), microbatches, device, generator)
            )
    return new_tokens


def generate_batch(
    module: DecoderStage,
    batch: Batch,
    decoding: Decoding,
    ranks: Ranks,
    stages: int,
    microbatches: int,
    device: torch.device,
    generator: Optional[torch.Generator],
) -> list[list[int]]:
    """One batch's new tokens, its rows cut into at most `microbatches` equal microbatches (the last row repeated
    to even them out)."""
    rows, prompt_length = batch["input_ids"].shape
    chunks = min(microbatches, rows)
    tokens, attention_mask = decoding_buffers(batch, decoding, math.ceil(rows / chunks) * chunks, device)
    stage = stage_for_buffer(module, tokens, ranks.rank, stages, chunks, device)
    schedule = ScheduleGPipe(stage, n_microbatches=chunks)
    is_first, is_last = ranks.rank == 0, ranks.rank == stages - 1
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    length = prompt_length
    while length < prompt_length + decoding.max_new_tokens and not finished.all():
        module.logits_position = length - 1
        logits = schedule.eval(tokens, attention_mask) if is_first else schedule.eval()
        chosen = torch.empty(rows, dtype=torch.long, device=device)
        if is_last:
            chosen = next_tokens(logits[:rows], tokens[:rows, :length], decoding, generator)
        dist.broadcast(chosen, src=stages - 1)
        # A finished row goes on with padding, as generate's rows do; it is cut after its eos below.
        chosen = chosen.masked_fill(finished, decoding.pad_token_id)
        tokens[:rows, length] = chosen
        if decoding.eos_token_id is not None:
            finished |= chosen == decoding.eos_token_id
        length += 1
    return [up_to_eos(row, decoding.eos_token_id) for row in tokens[:rows, prompt_length:length].tolist()]


def decoding_buffers(
    batch: Batch, decoding: Decoding, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token and attention-mask buffers [rows, prompt + max_new_tokens]: the prompts, then filler tokens marked
    real in the mask (as generate marks every new token). Rows beyond the batch's, which make the microbatches even,
    repeat its last row and are never read."""
    prompt_ids, prompt_mask = batch["input_ids"].long(), batch["attention_mask"].long()
    extra = rows - prompt_ids.shape[0]
    prompt_ids = torch.cat([prompt_ids, prompt_ids[-1:].expand(extra, -1)])
    prompt_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(extra, -1)])
    tokens = torch.full((rows, decoding.max_new_tokens), decoding.pad_token_id, dtype=torch.long)
    filler_mask = torch.ones((rows, decoding.max_new_tokens), dtype=torch.long)
    return (torch.cat([prompt_ids, tokens], dim=1).to(device), torch.cat([prompt_mask, filler_mask], dim=1).to(device))


def stage_for_buffer(
    module: DecoderStage, tokens: torch.Tensor, stage: int, stages: int, chunks: int, device: torch.device
) -> PipelineStage:
    """The PipelineStage with the shapes of one microbatch's inputs and outputs given, so that no stage has to infer
    them by a trial forward pass: tokens or hidden states with the attention mask in, hidden states with the mask
    or the last stage's logits [rows, vocab] out."""
    rows, length = tokens.shape[0] // chunks, tokens.shape[1]
    dtype = next(module.parameters()).dtype

    def example(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    mask = example(rows, length)
    hidden = example(rows, length, module.config.hidden_size, dtype=dtype)
    inputs = (example(rows, length), mask) if stage == 0 else (hidden, mask)
    if stage == stages - 1:
        outputs = example(rows, module.lm_head.weight.shape[0], dtype=dtype)
    else:
        outputs = (hidden, mask)
    return PipelineStage(module, stage, stages, device, input_args=inputs, output_args=outputs)
