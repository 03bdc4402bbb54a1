"""A sweep writes its report, one row per job, a failed job shown as failed while the others still run."""

import csv

from conftest import QUICK, run_cli

SHORT = [*QUICK, "train.max_steps=4", "train.log_every=2", "train.eval_every=0", "train.eval_batches=2",
         "train.save_model=false"]


def test_two_by_two_sweep_reports_four_jobs_one_failed(workdir):
    # 4 query heads cannot share 3 key-value heads: that job fails in its first forward; the other three train.
    result = run_cli("-m", *SHORT, "model.architecture.hidden_size=96", "model.architecture.num_attention_heads=6,4",
                     "model.architecture.num_key_value_heads=2,3", cwd=workdir)
    assert result.returncode != 0
    [sweep_dir] = workdir.glob("outputs/multirun/*/*")
    rows = list(csv.DictReader((sweep_dir / "report.csv").open()))
    assert len(rows) == 4
    failed = [row for row in rows if row["status"] == "failed"]
    assert len(failed) == 1
    assert failed[0]["overrides"].endswith(
        "model.architecture.num_attention_heads=4 model.architecture.num_key_value_heads=3")
    assert all(float(row["eval_loss"]) > 0 and float(row["tokens_per_s"]) > 0 for row in rows if row not in failed)
    assert (sweep_dir / "report.md").read_text().count("| completed |") == 3
    assert (sweep_dir / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
