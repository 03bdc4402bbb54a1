"""bench/test_budget.py, the test budget of issue 46: how it reads the default job's training time from the job's
output, without running the job or the suite."""

import json
import sys

import pytest

from tests.support import REPO

BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import test_budget  # noqa: E402  (bench/ is no package)

DONE = (
    "22:55:52 done: train loss 2.5076 | eval loss 2.6353 (from 5.4434) | 14,021 tokens/s (mean of the training "
    "steps) | peak memory 0.63 GiB | 33 s"
)


def test_the_training_time_is_the_done_lines_last_figure():
    output = "\n".join(
        [
            "22:55:10 step 200/200 | loss 2.5076 | lr 0.00e+00 | grad norm 0.412 | 14,100 tokens/s",
            DONE,
            "22:55:52 outputs: outputs/2026-11-27/22-55-12 (model: outputs/2026-11-27/22-55-12/model)",
            "22:55:52 use it: run task=generate task.trained=outputs/2026-11-27/22-55-12",
        ]
    )
    assert test_budget.training_seconds(output) == 33.0
    compiled = DONE.replace("| 33 s", "| 41 s (torch.compile: 12 s of it)")
    assert test_budget.training_seconds(compiled) == 41.0
    # a resumed job's output holds its earlier done line too: the last one counts
    assert test_budget.training_seconds(f"{DONE}\n{DONE.replace('| 33 s', '| 7 s')}") == 7.0


def test_no_done_line_is_an_error_not_a_time():
    with pytest.raises(ValueError, match="no done line"):
        test_budget.training_seconds("22:55:10 step 200/200 | loss 2.5076 | 33 s\nrun: error: something")


def test_the_summary_gives_the_same_time_unrounded(tmp_path):
    run_dir = tmp_path / "outputs" / "2026-11-27" / "22-55-12"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"wall_time_s": 33.21}))
    output = f"{DONE}\n22:55:52 outputs: outputs/2026-11-27/22-55-12 (model: outputs/2026-11-27/22-55-12/model)"
    assert test_budget.summary_seconds(output, tmp_path) == 33.21
    assert test_budget.summary_seconds(DONE, tmp_path) is None
