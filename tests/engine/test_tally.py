"""The loop's tally of the steps between two reads of the device (runner/engine/tally.py): what one reading gives,
in one process and summed over a gloo group."""

import math

import pytest
import torch

from runner.engine.tally import DeviceTally
from tests.support.workers import run_in_workers


def test_a_reading_sums_the_steps_since_the_last_one():
    tally = DeviceTally(torch.device("cpu"))
    for step, loss in enumerate([2.0, 1.5, 1.0], start=1):
        tally.add(
            step, torch.tensor(loss), {"rewards/margins": torch.tensor(step / 10)}, torch.tensor(0.5 * step), tokens=100
        )
    reading = tally.read()
    assert (reading.steps, reading.loss, reading.tokens, reading.first_non_finite) == (3, 4.5, 300, None)
    assert reading.grad_norm == 1.5  # the last step's
    assert reading.metrics == {"rewards/margins": pytest.approx(0.6)}
    tally.add(4, torch.tensor(0.5), {}, 2.0, tokens=torch.tensor(7))  # a host norm; a streamed run's device tokens
    assert (tally.read().loss, tally.steps) == (0.5, 0)


def test_the_first_non_finite_step_is_named_however_many_follow():
    tally = DeviceTally(torch.device("cpu"))
    for step, loss in enumerate([1.0, math.inf, math.nan, 1.0], start=1):
        tally.add(step, torch.tensor(loss), {}, torch.tensor(1.0), tokens=1)
    reading = tally.read()
    assert reading.first_non_finite == 2 and not math.isfinite(reading.loss)


def _read_on_each_rank(ranks, bad_step_of_rank, counted_ranks):
    tally = DeviceTally(torch.device("cpu"), counted=ranks.rank in counted_ranks)
    for step in range(1, 5):
        bad = bad_step_of_rank.get(ranks.rank) is not None and step >= bad_step_of_rank[ranks.rank]
        tally.add(step, torch.tensor(math.nan if bad else 1.0 + ranks.rank), {}, torch.tensor(1.0), tokens=1)
    first = tally.read()
    for step in range(5, 7):
        tally.add(step, torch.tensor(1.0), {}, torch.tensor(1.0), tokens=1)
    return first.first_non_finite, tally.read().loss


@pytest.mark.distributed
def test_every_rank_reads_the_sums_and_the_earliest_non_finite_step_of_any_rank():
    # rank 1 goes bad at step 3, rank 2 at step 2, rank 3 is not counted (a tensor-parallel group's other rank)
    results = run_in_workers(_read_on_each_rank, {1: 3, 2: 2}, {0, 1, 2}, nproc=4)
    assert [first for first, _ in results] == [2, 2, 2, 2]
    assert [loss for _, loss in results] == [6.0] * 4  # 2 steps x 3 counted ranks


def test_a_tensor_metric_reads_as_an_array_of_its_shape():
    tally = DeviceTally(torch.device("cpu"))
    for step in (1, 2):
        tally.add(step, torch.tensor(1.0), {"counts": torch.tensor([[1.0, 2.0], [3.0, 0.0]])}, 1.0, tokens=1)
    counts = tally.read().metrics["counts"]
    assert counts.shape == (2, 2) and counts.tolist() == [[2.0, 4.0], [6.0, 0.0]]
