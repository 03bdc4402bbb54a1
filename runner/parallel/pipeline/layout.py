"""Pipeline parallelism's layout: which decoder layers each stage holds, which stages each rank runs, and what a
schedule asks of the micro batches. Plain rules, without torch: validation asks them before launch, and
runner/parallel/pipeline/stages.py runs them.

A schedule of torch.distributed.pipelining runs the micro batches of one optimizer step through the stages: the
rank's micro batches (train.grad_accum_steps of them) are the pipeline's microbatches.

    GPipe            every forward, then every backward: in flight, all the microbatches' activations
    1F1B             one forward, one backward, once the pipeline is full: at most pp_size in flight; needs
                     at least pp_size microbatches
    Interleaved1F1B  1F1B over two stages a rank (rank r holds stages r and r + pp_size), which halves the
                     pipeline's idle start and end
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional

from runner.config.precision import Dtype
from runner.errors import require

if TYPE_CHECKING:
    from runner.config.spec import RunSpec


class PipelineSchedule(str, Enum):
    GPipe = "GPipe"
    ONE_F_ONE_B = "1F1B"
    Interleaved1F1B = "Interleaved1F1B"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self is PipelineSchedule.Interleaved1F1B else 1

    def in_flight(self, microbatches: int, pp: int, rank: int) -> float:
        """How many microbatches' activations of its layers pipeline rank `rank` holds at once, at most: every one
        under GPipe; pp - rank under 1F1B (the first rank the most); under Interleaved1F1B that times
        1 + (pp - 1) / (pp x 2) (Narayanan et al., 2021, section 2.2)."""
        if self is PipelineSchedule.GPipe:
            return microbatches
        one_f_one_b = min(microbatches, pp - rank)
        if self is PipelineSchedule.ONE_F_ONE_B:
            return one_f_one_b
        return one_f_one_b * (1 + (pp - 1) / (pp * self.stages_per_rank))

    def microbatches_problem(self, microbatches: int, pp: int) -> Optional[str]:
        """Why this schedule cannot run `microbatches` microbatches on `pp` ranks (torch's own conditions), or None."""
        if self is PipelineSchedule.ONE_F_ONE_B and microbatches < pp:
            return f"1F1B needs at least as many microbatches as stages ({pp})"
        rounds = max(1, microbatches // pp)
        if self is PipelineSchedule.Interleaved1F1B and microbatches % rounds:
            return (
                f"Interleaved1F1B runs the microbatches in rounds of {pp} (the ranks): it needs fewer than {pp}, "
                f"or a multiple of their {rounds} rounds"
            )
        return None


def stage_bounds(num_layers: int, stages: int, split_points: Optional[list[int]] = None) -> list[tuple[int, int]]:
    """[first, end) decoder-layer indices of each stage: an even split (the earlier stages take the layers left
    over, the last one holding the LM head), or the given split points, the layers where stages 1.. start."""
    require(stages >= 1, f"pipeline stages must be at least 1, got {stages}")
    if split_points is None:
        require(
            stages <= num_layers,
            f"{stages} pipeline stages need at least {stages} decoder layers; the model has {num_layers}",
        )
        size, left_over = divmod(num_layers, stages)
        starts = [stage * size + min(stage, left_over) for stage in range(stages)]
    else:
        points = list(split_points)
        require(
            len(points) == stages - 1,
            f"pipeline split points: {stages} stages need {stages - 1} (the layers where stages 1.. start), "
            f"got {len(points)}: {points}",
        )
        require(
            all(a < b for a, b in zip(points, points[1:])), f"pipeline split points must be increasing, got {points}"
        )
        require(
            not points or (0 < points[0] and points[-1] < num_layers),
            f"pipeline split points must lie between 1 and {num_layers - 1} (the model has {num_layers} "
            f"decoder layers), got {points}",
        )
        starts = [0, *points]
    return list(zip(starts, [*starts[1:], num_layers]))


def balanced_bounds(model, stages: int) -> list[tuple[int, ...]]:
    """[first, end) decoder-layer indices of each training stage (a transformers causal LM), balanced by the
    parameters each stage holds: the first stage's embeddings and the last's head count as the layers they weigh.
    The stage holding the most holds as little as it can, and among such splits the stages are the most even (the
    least sum of squares)."""
    layers = model.config.num_hidden_layers
    require(stages <= layers, f"{stages} pipeline stages need at least {stages} decoder layers; the model has {layers}")
    cost, first_extra, last_extra = [0] * layers, 0, 0
    for name, parameter in model.named_parameters():
        part = _part(name, model.config.tie_word_embeddings)
        if isinstance(part, int):
            cost[part] += parameter.numel()
        first_extra += parameter.numel() if part in ("first", "both") else 0
        last_extra += parameter.numel() if part in ("last", "both") else 0
    prefix = [0]
    for value in cost:
        prefix.append(prefix[-1] + value)

    def stage_cost(stage: int, start: int, end: int) -> int:
        return (
            prefix[end]
            - prefix[start]
            + (first_extra if stage == 0 else 0)
            + (last_extra if stage == stages - 1 else 0)
        )

    # best[s][i]: over splits of the first i layers into s + 1 stages, the least (largest stage, sum of squares),
    # and where the last of them starts.
    unreachable = (math.inf, math.inf, 0)
    best = [[(stage_cost(0, 0, i), stage_cost(0, 0, i) ** 2, 0) if i else unreachable for i in range(layers + 1)]]
    for stage in range(1, stages):
        row = []
        for end in range(layers + 1):
            splits = []
            for start in range(stage, end):
                largest, squares, _ = best[stage - 1][start]
                cost = stage_cost(stage, start, end)
                splits.append((max(largest, cost), squares + cost**2, start))
            row.append(min(splits, default=unreachable))
        best.append(row)
    bounds, end = [], layers
    for stage in range(stages - 1, -1, -1):
        start = best[stage][end][2]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def stage_parameters(
    model, bounds: list[tuple[int, int]], shapes: list[tuple[int, ...]]
) -> list[list[tuple[int, ...]]]:
    """The shapes of each stage's parameters (a transformers causal LM, on the meta device; `shapes` in the order of
    its parameters: whole, or a tensor-parallel rank's parts): its decoder layers', the embeddings on the first
    stage and the final norm and head on the last; tied embeddings on both."""
    last = len(bounds) - 1
    held: list[list[tuple[int, ...]]] = [[] for _ in bounds]
    for (name, _), shape in zip(model.named_parameters(), shapes):
        part = _part(name, model.config.tie_word_embeddings)
        if isinstance(part, int):
            owners = [stage for stage, (first, end) in enumerate(bounds) if first <= part < end]
        else:
            owners = {"first": [0], "last": [last], "both": [0, last]}[part]
        for stage in owners:
            held[stage].append(tuple(shape))
    return held


def _part(name: str, tied: bool):
    """Where a parameter sits in a pipeline: its decoder layer's index, or the first stage (the embeddings and
    anything outside the layers), the last (the final norm and head), or both (tied embeddings)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    if name.startswith("model.embed_tokens."):
        return "both" if tied else "first"
    return "last" if name.startswith(("model.norm.", "lm_head.")) else "first"


def stages_of(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages a rank runs, in order: its own, or (interleaved) one in each round of pp stages."""
    return [pp_rank + round_ * pp for round_ in range(stages_per_rank)]


def check_pipeline(strategy: Any, spec: RunSpec) -> None:
    """What the pipeline cannot run (`strategy`: strategy=fsdp's schema), refused before launch."""
    pp, train = f"strategy.pp_size={strategy.pp_size}", spec.train
    schedules = [schedule.value for schedule in PipelineSchedule]
    require(
        strategy.pp_schedule in schedules,
        f"strategy.pp_schedule={strategy.pp_schedule} is not a schedule; use one of {', '.join(schedules)}",
    )
    schedule = strategy.pipeline_schedule
    stages = strategy.pp_size * schedule.stages_per_rank
    layers = spec.model.architecture.get("num_hidden_layers")
    require(
        layers is None or stages <= layers,
        f"{pp} with strategy.pp_schedule={strategy.pp_schedule} cuts the model into {stages} stages, more "
        f"than its {layers} decoder layers",
    )
    problem = schedule.microbatches_problem(train.grad_accum_steps, strategy.pp_size)
    require(
        problem is None,
        f"strategy.pp_schedule={strategy.pp_schedule} with {pp}: {problem}, and a step has "
        f"{train.grad_accum_steps} (train.grad_accum_steps, the micro batches each rank runs a step); raise "
        "train.grad_accum_steps, or use strategy.pp_schedule=GPipe",
    )
    for refused, why in (
        (
            spec.data.seq_len % strategy.tp_size != 0,
            f"strategy.tp_size={strategy.tp_size}: data.seq_len="
            f"{spec.data.seq_len} must be a multiple of it (the stages pass on "
            "each tensor-parallel rank's equal part of the sequence)",
        ),
        (spec.adapter.active, f"adapter={spec.adapter.kind.value}: the adapters are not cut into stages yet"),
        (bool(spec.precision.fp8), "precision.fp8: float8 layers are not cut into stages yet"),
        (
            spec.precision.compute_dtype is Dtype.fp16 and spec.precision.param_dtype is not Dtype.fp16,
            "precision=fp16: the schedule runs the backward itself, without fp16's loss scaling; use bf16",
        ),
        (train.compile, "train.compile=true: the stages run eagerly; set train.compile=false"),
        (
            strategy.cpu_ram_efficient_loading,
            "strategy.cpu_ram_efficient_loading=true: every rank builds the model "
            "and keeps its stages' weights; set it to false",
        ),
    ):
        require(not refused, f"{pp} with {why}")
