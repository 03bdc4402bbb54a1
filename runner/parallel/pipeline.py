"""Pipeline parallelism's layout: which decoder layers each stage holds, which stages each rank runs, and what a
schedule asks of the micro batches. Plain rules, without torch: validation asks them before launch, and
runner/parallel/stages.py runs them.

A schedule of torch.distributed.pipelining runs the micro batches of one optimizer step through the stages: the
rank's micro batches (train.grad_accum_steps of them) are the pipeline's microbatches.

    GPipe            every forward, then every backward: in flight, all the microbatches' activations
    1F1B             one forward, one backward, once the pipeline is full: at most pp_size in flight; needs
                     at least pp_size microbatches
    Interleaved1F1B  1F1B over two stages a rank (rank r holds stages r and r + pp_size), which halves the
                     pipeline's idle start and end
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from runner.errors import require


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
            return (f"Interleaved1F1B runs the microbatches in rounds of {pp} (the ranks): it needs fewer than {pp}, "
                    f"or a multiple of their {rounds} rounds")
        return None


def stage_bounds(num_layers: int, stages: int, split_points: Optional[list[int]] = None) -> list[tuple[int, int]]:
    """[first, end) decoder-layer indices of each stage: an even split (the earlier stages take the layers left
    over, the last one holding the LM head), or the given split points, the layers where stages 1.. start."""
    require(stages >= 1, f"pipeline stages must be at least 1, got {stages}")
    if split_points is None:
        require(stages <= num_layers,
                f"{stages} pipeline stages need at least {stages} decoder layers; the model has {num_layers}")
        size, left_over = divmod(num_layers, stages)
        starts = [stage * size + min(stage, left_over) for stage in range(stages)]
    else:
        points = list(split_points)
        require(len(points) == stages - 1,
                f"pipeline split points: {stages} stages need {stages - 1} (the layers where stages 1.. start), "
                f"got {len(points)}: {points}")
        require(all(a < b for a, b in zip(points, points[1:])),
                f"pipeline split points must be increasing, got {points}")
        require(not points or (0 < points[0] and points[-1] < num_layers),
                f"pipeline split points must lie between 1 and {num_layers - 1} (the model has {num_layers} "
                f"decoder layers), got {points}")
        starts = [0, *points]
    return list(zip(starts, [*starts[1:], num_layers]))


def stage_parameters(model, stages: int, shapes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """The shapes of each stage's parameters (a transformers causal LM, on the meta device; `shapes` in the order of
    its parameters: whole, or a tensor-parallel rank's parts): its decoder layers', the embeddings on the first
    stage and the final norm and head on the last; tied embeddings on both."""
    bounds = stage_bounds(model.config.num_hidden_layers, stages)
    last = stages - 1
    held: list[list[tuple[int, ...]]] = [[] for _ in range(stages)]
    for (name, _), shape in zip(model.named_parameters(), shapes):
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            owners = [stage for stage, (first, end) in enumerate(bounds) if first <= layer < end]
        elif name.startswith("model.embed_tokens."):
            owners = [0, last] if model.config.tie_word_embeddings else [0]
        else:
            owners = [last] if name.startswith(("model.norm.", "lm_head.")) else [0]
        for stage in owners:
            held[stage].append(tuple(shape))
    return held


def stages_of(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages a rank runs, in order: its own, or (interleaved) one in each round of pp stages."""
    return [pp_rank + round_ * pp for round_ in range(stages_per_rank)]
