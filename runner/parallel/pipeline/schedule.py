"""Pipeline-parallel training's step and evaluation: this rank's micro batches through its stages, in the order of
a torch.distributed.pipelining schedule (layout.py beside it: the schedules and stage bounds; stages.py: the
stages).

The schedule runs all micro batches of an optimizer step in one call, each of them one of its microbatches. Every
micro batch is padded to [micro_batch_size, seq_len], so that the stages exchange tensors of one shape, declared
up front. The padding carries the label IGNORE, and padded rows the mask that hides them: the loss is the unpadded
one. The last stage returns each micro batch's summed loss; scaled by dp_size / the global batch's label tokens
(the schedule adds up the gradients, scale_grads=False) its backward gives the gradients of the mean loss, as the
loop's own step does.

Gradients are combined across stages where a parameter's parts sit on several: a tied LM head and embeddings are
one parameter held by the first stage and the last, whose gradients are summed; the gradient norm is taken over
every stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runner.data.batches import MeanLoss, MicroBatch
from runner.data.rows import IGNORE
from runner.distributed import all_ranks_sums, local
from runner.parallel.pipeline.layout import PipelineSchedule
from runner.parallel.pipeline.stages import INPUT_EMBEDDINGS, OUTPUT_EMBEDDINGS

if TYPE_CHECKING:
    from runner.config.spec import RunSpec
    from runner.data.batches import GlobalBatch
    from runner.parallel.dims import ParallelDims
    from runner.parallel.pipeline.stages import TrainingStage


@dataclass
class Pipeline:
    schedule: Any  # a torch.distributed.pipelining schedule over this rank's stages
    first: bool  # whether this rank runs the first stage, which takes the tokens
    last: bool  # whether it runs the last, which returns the loss
    microbatches: int  # a step's: train.grad_accum_steps
    rows: int  # micro_batch_size
    length: int  # seq_len
    pad_token_id: int
    pp_group: Any
    leads_stage: bool  # whether this rank keeps its stage's whole state for rank 0 (the one in rank 0's pipeline)
    # The tied embeddings' parameter on the first and last stages, and the group of the two ranks holding it.
    tied: Optional[nn.Parameter] = None
    tied_group: Any = None
    scale: float = 1.0  # what the schedule's loss multiplies each micro batch's summed loss by

    def train(self, batch: GlobalBatch, dp_size: int, autocast: Callable[[], ContextManager]) -> torch.Tensor:
        """Forward and backward of every micro batch of the step; this rank's share of the step's mean loss (the
        last stage's; 0 on the others), on the device."""
        inputs = self._stacked(batch.micro_batches)
        self.scale = dp_size / batch.label_tokens
        losses: list[torch.Tensor] = []
        with autocast():
            self._run(self.schedule.step, inputs, losses)
        if self.tied is not None:
            dist.all_reduce(local(self.tied.grad), group=self.tied_group)
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=inputs[0].device)
        return torch.stack([loss.detach() for loss in losses]).double().sum() / dp_size

    def mean_loss(
        self, batches: Iterable[MicroBatch], autocast: Callable[[], ContextManager], counted: bool
    ) -> MeanLoss:
        """The mean next-token loss over the eval batches of every data-parallel rank, forward only; a step's
        worth of micro batches at a time (the last group filled with copies that have no labels)."""
        self.scale = 1.0
        batches = list(batches)
        microbatches, loss_sum = self.microbatches, 0.0
        with torch.no_grad(), autocast():
            for start in range(0, len(batches), microbatches):
                group = batches[start : start + microbatches]
                group += [_without_labels(group[0])] * (microbatches - len(group))
                losses: list[torch.Tensor] = []
                self._run(self.schedule.eval, self._stacked(group), losses)
                loss_sum += sum(float(loss.detach()) for loss in losses)
        totals = all_ranks_sums(
            [loss_sum, sum(b.label_tokens for b in batches), sum(b.tokens for b in batches)], counted
        )
        return MeanLoss(totals[0] / totals[1], int(totals[1]), int(totals[2]))

    def whole_model_names(self) -> dict[str, str]:
        return {OUTPUT_EMBEDDINGS: INPUT_EMBEDDINGS} if self.last and self.tied is not None else {}

    def keeps_whole(self) -> bool:
        return self.leads_stage

    def to_rank0(self, value: Any) -> Optional[list[Any]]:
        """Each stage's `value`, from the rank that keeps its stage's whole state (the one at the mesh's origin on
        every other dimension), gathered on rank 0 over their pipeline group."""
        if not self.leads_stage:
            return None
        every_stage = [None] * dist.get_world_size(self.pp_group) if dist.get_rank() == 0 else None
        dist.gather_object(value, every_stage, dst=0, group=self.pp_group)
        return every_stage

    def parameters(self, own: int) -> int:
        """The whole model's parameter count, from this rank's stages' `own` (the tied parameter once)."""
        counts = torch.tensor([own, self.tied.numel() if self.tied is not None else 0], dtype=torch.float64)
        dist.all_reduce(counts, group=self.pp_group)
        return int(counts[0] - counts[1] / 2)  # the tied parameter is on two stages

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The norm of the whole model's gradients: this rank's (its FSDP shards' combined), those of the other
        stages, and the tied parameter's once."""
        own = [grad for grad in grads if not (self.last and self.tied is not None and grad is self.tied.grad)]
        norm = torch.nn.utils.get_total_norm(own) if own else torch.zeros((), device=grads[0].device)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.pp_group)
        return squared.sqrt()

    def _run(self, run: Callable, inputs: tuple[torch.Tensor, ...], losses: list) -> None:
        arguments = inputs if self.first else ()
        target = inputs[1] if self.last else None
        run(*arguments, target=target, losses=losses, return_outputs=False)

    def _stacked(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, ...]:
        """(input_ids, labels, position_ids, attention_mask) of the micro batches, each padded to [rows, length],
        one after the other along the rows: the schedule cuts them back into the micro batches."""
        padded = [self._padded(micro_batch) for micro_batch in micro_batches]
        return tuple(torch.cat(parts) for parts in zip(*padded))

    def _padded(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, ...]:
        inputs, labels = micro_batch.inputs, micro_batch.labels
        rows, length = labels.shape
        extra = self.length - length
        input_ids = F.pad(inputs["input_ids"], (0, extra), value=self.pad_token_id)
        labels = F.pad(labels, (0, extra), value=IGNORE)
        if "position_ids" in inputs:  # packed rows: the padding is a segment of its own, as collate makes it
            tail = torch.arange(extra, device=labels.device).expand(rows, extra)
            position_ids = torch.cat([inputs["position_ids"], tail], dim=1)
            attention_mask = torch.ones_like(input_ids)
        else:
            position_ids = torch.arange(self.length, device=labels.device).expand(rows, self.length)
            mask = inputs.get("attention_mask")  # none where no row is padded
            attention_mask = F.pad(torch.ones_like(inputs["input_ids"]) if mask is None else mask, (0, extra), value=0)
        tensors = (input_ids, labels, position_ids.contiguous(), attention_mask)
        if rows < self.rows:  # an eval batch's last: filled with copies of its first row, without labels
            fill = self.rows - rows
            tensors = tuple(
                torch.cat([t, (torch.full_like(t[:1], IGNORE) if t is labels else t[:1]).expand(fill, -1)])
                for t in tensors
            )
        return tensors


def _without_labels(micro_batch: MicroBatch) -> MicroBatch:
    return MicroBatch(micro_batch.inputs, torch.full_like(micro_batch.labels, IGNORE), 0, 0)


def build_pipeline(
    stages: list[TrainingStage],
    stage_ids: list[int],
    spec: RunSpec,
    dims: ParallelDims,
    rank: int,
    device: torch.device,
    pad_token_id: int,
) -> Pipeline:
    """The schedule of this rank's stages (already sharded by the strategy), with the shapes they exchange."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    strategy, train = spec.strategy, spec.train
    mesh = dims.mesh(device.type)
    pp_group = mesh.get_group("pp")
    rows, length, count = train.micro_batch_size, spec.data.seq_len, dims.pp * len(stage_ids)
    # (under tensor parallelism, each rank's part of the sequence)
    hidden = _example(
        rows,
        length // dims.tp,
        stages[0].config.hidden_size,
        dtype=spec.precision.compute_dtype.torch,
        requires_grad=True,
    )
    passed_on = (hidden, *(_example(rows, length) for _ in range(3)))
    pipeline_stages = []
    for module, index in zip(stages, stage_ids):
        inputs = (_example(rows, length), *passed_on[1:]) if index == 0 else passed_on
        outputs = _example(1, dtype=torch.float32, requires_grad=True) if index == count - 1 else passed_on
        pipeline_stages.append(
            PipelineStage(module, index, count, device, input_args=inputs, output_args=outputs, group=pp_group)
        )
    origin = dims.dp_rank(rank) == 0 and rank % dims.tp == 0
    pipeline = Pipeline(
        None,
        first=0 in stage_ids,
        last=count - 1 in stage_ids,
        microbatches=train.grad_accum_steps,
        rows=rows,
        length=length,
        pad_token_id=pad_token_id,
        pp_group=pp_group,
        leads_stage=origin,
    )

    def loss(summed: torch.Tensor, _labels: torch.Tensor) -> torch.Tensor:
        return summed * pipeline.scale

    schedule = strategy.pipeline_schedule
    options = dict(n_microbatches=pipeline.microbatches, loss_fn=loss, scale_grads=False)
    if schedule is PipelineSchedule.Interleaved1F1B:
        pipeline.schedule = ScheduleInterleaved1F1B(pipeline_stages, **options)
    else:
        single = ScheduleGPipe if schedule is PipelineSchedule.GPipe else Schedule1F1B
        pipeline.schedule = single(pipeline_stages[0], **options)
    if stages[0].config.tie_word_embeddings:
        _tie_across_stages(pipeline, stages, mesh)
    return pipeline


def _tie_across_stages(pipeline: Pipeline, stages: list[TrainingStage], mesh) -> None:
    """The group of each first-stage rank and the last-stage rank at the same place on the other dimensions, which
    hold the two ends of the tied embeddings (every rank takes part in making the groups)."""
    ranks = mesh.mesh
    pairs = [[int(first), int(last)] for first, last in zip(ranks[0].flatten(), ranks[-1].flatten())]
    pipeline.tied_group, _ = dist.new_subgroups_by_enumeration(pairs)
    if pipeline.first:
        pipeline.tied = stages[0].model.embed_tokens.weight
    elif pipeline.last:
        pipeline.tied = stages[-1].lm_head.weight


def _example(*shape: int, dtype: torch.dtype = torch.long, requires_grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)
