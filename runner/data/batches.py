"""Batches: the rows each rank trains on and evaluates, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterator, Optional

from runner.data.rows import IGNORE, RowSet, columns

if TYPE_CHECKING:
    import torch

    from runner.data.stream import StreamedRows

Batch = dict[str, "torch.Tensor"]  # the model's inputs and the labels


@dataclass
class MicroBatch:
    # The forward's: input_ids, with attention_mask (where a row is padded: none when every row has the batch's
    # length, as transformers would read an all-ones mask back to the host) or position_ids (packed rows).
    inputs: Batch
    labels: torch.Tensor
    tokens: int  # its tokens, padding aside
    label_tokens: int  # its predicted labels: every label but each row's (and packed segment's) first, not IGNORE
    # The rows' indices in the token store, where they say (preference pairs: what a precomputed reference reads).
    store_rows: Optional[list[int]] = None
    # Whether `labels` are each position's target already (context parallelism shifts them before the split).
    labels_shifted: bool = False
    # Values of each row (or each row's positions) that its objective reads: task=grpo's advantages, rewards and
    # log-probs of the sampled tokens (runner/generation/rollout.py).
    row_values: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> MicroBatch:
        """On the device; from pinned memory (collate's, on CUDA) the copies overlap the host's work."""
        return replace(
            self,
            inputs={k: v.to(device, non_blocking=True) for k, v in self.inputs.items()},
            labels=self.labels.to(device, non_blocking=True),
            row_values={k: v.to(device, non_blocking=True) for k, v in self.row_values.items()},
        )


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target: the next position's label (the last position gets IGNORE)."""
    import torch.nn.functional as F

    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


@dataclass
class GlobalBatch:
    """This rank's micro batches of one optimizer step, and the counts of the whole global batch (every rank's),
    read from the rows: nothing to sum across ranks before the forward."""

    micro_batches: list[MicroBatch]
    tokens: int
    label_tokens: int
    # A streamed rank's position after this batch (runner/data/stream.py), which its checkpoint keeps.
    stream_position: Optional[dict[str, int]] = None
    # Whether `tokens` and `label_tokens` are this rank's alone (a streamed rank's, whose rows the others' do not
    # tell), for the step to sum across the ranks on the device (runner/engine/step.py).
    rank_counts: bool = False
    # Whether the next step trains on these rows again (task.num_iterations of task=grpo): a checkpoint keeps them.
    trained_again: bool = False


def batch_tensors(batch: GlobalBatch) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A global batch's tensors by name, and its counts: what a checkpoint keeps of rows trained again."""
    tensors: dict[str, torch.Tensor] = {}
    for i, micro_batch in enumerate(batch.micro_batches):
        tensors |= {f"{i}/inputs/{name}": value for name, value in micro_batch.inputs.items()}
        tensors |= {f"{i}/values/{name}": value for name, value in micro_batch.row_values.items()}
        tensors[f"{i}/labels"] = micro_batch.labels
    counts = {
        "tokens": int(batch.tokens),
        "label_tokens": int(batch.label_tokens),
        "rank_counts": batch.rank_counts,
        "micro_batches": [[micro_batch.tokens, micro_batch.label_tokens] for micro_batch in batch.micro_batches],
    }
    return tensors, counts


def batch_from_tensors(tensors: dict[str, torch.Tensor], counts: dict[str, Any]) -> GlobalBatch:
    def named(i: int, part: str) -> dict[str, torch.Tensor]:
        prefix = f"{i}/{part}/"
        return {name[len(prefix) :]: value for name, value in tensors.items() if name.startswith(prefix)}

    micro_batches = [
        MicroBatch(named(i, "inputs"), tensors[f"{i}/labels"], tokens, label_tokens, row_values=named(i, "values"))
        for i, (tokens, label_tokens) in enumerate(counts["micro_batches"])
    ]
    return GlobalBatch(micro_batches, counts["tokens"], counts["label_tokens"], rank_counts=counts["rank_counts"])


def collate(rows: dict[str, list], pad_token_id: int, pin: bool = False) -> MicroBatch:
    """Right-pads a batch to its longest row; padding carries the label IGNORE. Padded rows mask it out with an
    attention mask (none where no row is padded); packed rows make it a segment of its own, so that no real token
    attends to it. Built with numpy, in pinned memory when `pin` (CUDA: MicroBatch.to copies it without waiting)."""
    import numpy as np
    import torch

    lengths = np.array([len(ids) for ids in rows["input_ids"]])
    length = int(lengths.max())

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).pin_memory() if pin else torch.from_numpy(array)

    def matrix(seqs: list, tail: Any) -> torch.Tensor:  # each row's sequence, then tail(its padding's length)
        out = np.empty((len(seqs), length), dtype=np.int64)
        for row, seq in zip(out, seqs):
            row[: len(seq)] = seq
            row[len(seq) :] = tail(length - len(seq))
        return tensor(out)

    inputs = {"input_ids": matrix(rows["input_ids"], lambda _: pad_token_id)}
    if "position_ids" in rows:
        inputs["position_ids"] = matrix(rows["position_ids"], np.arange)
    elif (lengths < length).any():
        inputs["attention_mask"] = tensor((np.arange(length) < lengths[:, None]).astype(np.int64))
    return MicroBatch(
        inputs,
        matrix(rows["labels"], lambda _: IGNORE),
        sum(rows["tokens"]),
        sum(rows["label_tokens"]),
        rows.get("store_row"),
    )


def train_batches(
    rows: RowSet,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    pad_token_id: int,
    start_step: int = 0,
    pin: bool = False,
) -> Iterator[GlobalBatch]:
    """For each optimizer step after start_step, this rank's micro batches.

    Every epoch draws one seeded permutation of the rows and cuts it into global batches of
    micro_batch_size x dp_size x grad_accum_steps rows; rank r takes the r-th contiguous slice of each.
    The global batch of a step is therefore the same whatever the strategy and process count.
    """
    import torch

    per_rank = micro_batch_size * grad_accum_steps
    global_batch = per_rank * dp_size
    steps_per_epoch = len(rows) // global_batch
    epoch, first = divmod(start_step, steps_per_epoch)
    while True:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).numpy()
        for start in range(first * global_batch, steps_per_epoch * global_batch, global_batch):
            everyone = order[start : start + global_batch]
            mine = order[start + dp_rank * per_rank : start + (dp_rank + 1) * per_rank]
            yield GlobalBatch(
                [
                    collate(rows.batch(mine[i : i + micro_batch_size]), pad_token_id, pin)
                    for i in range(0, per_rank, micro_batch_size)
                ],
                tokens=int(rows.tokens[everyone].sum()),
                label_tokens=int(rows.label_tokens[everyone].sum()),
            )
        epoch, first = epoch + 1, 0


def streamed_batches(
    stream: StreamedRows,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    pad_token_id: int,
    position: Optional[dict[str, Any]] = None,
    pin: bool = False,
) -> Iterator[GlobalBatch]:
    """For each optimizer step, this rank's micro batches from its own stream, from a checkpoint's `position` on.
    The data-parallel ranks' rows differ: the batch carries this rank's counts, which the step sums across them."""
    from runner.data.stream import position_of

    rows = stream.rows(position_of(position))
    while True:
        taken = [next(rows) for _ in range(micro_batch_size * grad_accum_steps)]
        mine = [row for row, _ in taken]
        yield GlobalBatch(
            [
                collate(columns(mine[i : i + micro_batch_size]), pad_token_id, pin)
                for i in range(0, len(mine), micro_batch_size)
            ],
            tokens=sum(row["tokens"] for row in mine),
            label_tokens=sum(row["label_tokens"] for row in mine),
            stream_position=taken[-1][1].as_dict(),
            rank_counts=True,
        )


def eval_batches(
    rows: RowSet,
    *,
    micro_batch_size: int,
    max_batches: int,
    dp_rank: int,
    dp_size: int,
    pad_token_id: int,
    pin: bool = False,
) -> Iterator[MicroBatch]:
    """This rank's share of the first max_batches x micro_batch_size eval rows, in batches of micro_batch_size.

    The rows are the same whatever the number of ranks (rounded down to a multiple of it, so that every rank runs
    the same number of forward passes).
    """
    count = min(len(rows), max_batches * micro_batch_size) // dp_size * dp_size
    share = count // dp_size
    first = dp_rank * share
    for start in range(first, first + share, micro_batch_size):
        yield collate(rows.batch(range(start, min(start + micro_batch_size, first + share))), pad_token_id, pin)


@dataclass
class MeanLoss:
    loss: float  # over every label token of every rank's rows
    label_tokens: int
    tokens: int  # the rows' tokens, padding aside
