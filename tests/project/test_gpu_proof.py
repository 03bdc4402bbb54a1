"""bench/gpu_proof.py, the GPU proof of issue 45, without a GPU: its dry run composes every command it would run and
checks it as `run` checks a user's (so that a renamed key or option fails here, not on the next GPU), and its
report reads runs' records as the runs write them."""

import argparse
import json
import sys
from pathlib import Path

import pytest

from tests.support import REPO

BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import gpu_proof  # noqa: E402  (bench/ is no package)


def test_the_dry_run_composes_every_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["gpu_proof.py", "--dry-run", "--keep", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_status:
        gpu_proof.main()
    printed = capsys.readouterr().out
    assert exit_status.value.code == 0, printed
    runs = gpu_proof.needed(gpu_proof.plan(), list(gpu_proof.SECTIONS))
    assert f"{len(runs)} commands composed, 0 refused" in printed
    assert {run.section for run in runs} == set(gpu_proof.SECTIONS)
    assert "REFUSED" not in printed
    assert "hardware=auto precision=bf16 hydra.run.dir=" in printed  # the default job, as a user types it
    assert printed.count("hand_loop.py --plan") == sum(run.hand for run in runs)


def test_a_renamed_key_is_refused(tmp_path):
    run = gpu_proof.Run("renamed", "strategies", ["strategy=fsdp", "strategy.sharding=FULL_SHARD"], 10, 10)
    [(_, line, refusal)] = gpu_proof.dry_run([run], tmp_path)
    assert "strategy.sharding=FULL_SHARD" in line and refusal and "sharding" in refusal


def fake_run(run: gpu_proof.Run, folder: Path, loss_shift: float = 0.0) -> gpu_proof.Outcome:
    """An outcome as a finished run leaves it: records every log step, a summary, the files in its directory."""
    steps, log_every = (200, 20) if run.key == "default job" else (run.steps(), run.log_every())  # conf's defaults
    tokens = 4 * 2048 if "llama3_2_1b" in " ".join(run.overrides) else 8 * 256
    records = [
        {
            "step": step,
            "time": 1000.0 + step * 0.1,
            "loss": 5.0 - 0.04 * step + loss_shift,
            "tokens_per_s": tokens * 10.0,
            "mfu": 0.3,
            "tokens_seen": step * tokens,
            "tokens": step * tokens,
            "peak_memory_gib": 20.0,
        }
        for step in range(log_every, steps + 1, log_every)
    ]
    summary = {
        "first_eval_loss": 5.4,
        "eval_loss": 2.4,
        "tokens_per_s": tokens * 10.0,
        "peak_memory_gib": 20.0,
        "wall_time_s": 9.0,
        "compile_time_s": 30.0,
        "precision": {"fp8_linear_layers": 112},
    }
    out = folder / run.slug
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "summary.json").write_text(json.dumps(summary))
    return gpu_proof.Outcome(wall_s=12.0, records=records, summary=summary, run_dir=out)


def test_the_report_reads_the_runs(tmp_path):
    args = argparse.Namespace(budget=465.0, allow_cpu=False, jobs=9, threads=4)
    proof = gpu_proof.Proof(args, tmp_path)
    proof.gpus, proof.device_name = 2, "NVIDIA H100 80GB HBM3"
    for run in gpu_proof.plan():
        shift = 0.002 if run.key == "strategy zero-3" else 0.0  # 0.002 on losses of 2.6 to 5: under 1e-3
        proof.outcomes[run.key] = fake_run(run, tmp_path, shift)
        if run.section == "memory" or run.key == "1B bf16 eager":
            proof.estimates[run.key] = (21.0, "at the optimizer step")  # +5% of the 20 GiB measured
    proof.outcomes["hand tiny"].records = [
        {**r, "time": 1000.0 + r["step"] * 0.11}  # the runner 1.1x the hand loop
        for r in proof.outcomes["hand tiny"].records
    ]
    proof.outcomes["strategy fsdp"] = gpu_proof.Outcome(error="exit 1: RuntimeError: NCCL")
    # The line the runner's report makes of a rank that NCCL's watchdog ended (tests/processes/test_launch.py makes it).
    (proof.outcomes["2 GPUs: ddp, rank 1 stopped"].run_dir / "output.txt").write_text(
        "10:00:05 step 6/1000 | loss 5.1\nrun: error: rank 0 failed: Signal 6 (SIGABRT) received by PID 4242, after "
        "it waited 30 s in a collective that another rank did not join, in step 7: nccl:all_reduce #31 of group "
        "default_pg, Float [402432]; the process group's timeout (train.collective_timeout_s) ended it (see r.log)\n"
    )
    page = gpu_proof.Report(proof, list(gpu_proof.SECTIONS)).build()

    assert "NVIDIA H100 80GB HBM3 x 2" in page
    assert "- MET: the default job (`run hardware=auto precision=bf16`) trains: eval loss 5.4000 -> 2.4000" in page
    assert "- MISSED: every strategy trains on one process (exit 0, finite losses): 4 of 5" in page
    assert "| fsdp | failed: exit 1: RuntimeError: NCCL |" in page
    assert "- MISSED: their per-step losses agree" in page  # fsdp has no losses to agree
    assert "- MET: runner at least 0.98x the hand-written loop on the tiny model (the host's cost): 1.100x" in page
    assert (
        "- MET: the memory estimate within ±10% of the measured peak for every single-GPU config: largest +5.0%" in page
    )
    assert "| fp8 rowwise | compiled | 81,920 | 1.00x | 30.0% | 20.0 | 30 | 112 |" in page
    assert "- MET: NCCL equivalence of ddp, fsdp, ZeRO-2 and ZeRO-3 on 2 processes" in page
    assert "- MET: async TP (strategy.async_tp) against compiled tp: trains" in page
    assert "- MET: a collective that a stopped rank never joins ends the job in one line (12 s in all" in page
    assert "- strategy fsdp: failed: exit 1: RuntimeError: NCCL" in page.split("### What did not run, or failed")[1]

    proof.gpus = 1
    one_gpu = gpu_proof.Report(proof, ["multi"]).build()
    assert one_gpu.count("- skipped: ") == len(gpu_proof.MULTI_ITEMS)


def test_the_page_keeps_what_is_above_its_figures(tmp_path):
    page = tmp_path / "gpu.md"
    page.write_text(gpu_proof.DOC.read_text())
    gpu_proof.write_doc(page, "## Figures\n\nnew figures\n")
    gpu_proof.write_doc(page, "## Figures\n\nnewer figures\n")
    text = page.read_text()
    assert text.startswith("# The runner on a GPU")
    assert text.count(gpu_proof.FIGURES_MARK) == 1 and text.endswith("newer figures\n")
    assert "new figures" not in text and "Not yet run on a GPU" not in text


def test_memory_runs_share_the_gpu_as_their_estimates_allow(tmp_path):
    proof = gpu_proof.Proof(argparse.Namespace(budget=465.0, allow_cpu=False, jobs=9, threads=4), tmp_path)
    runs = [run for run in gpu_proof.plan() if run.section == "memory"]
    # The estimates of the four configs, GiB (runner/memory's, on 2026-11-27).
    for run, peak in zip(runs, (28.55, 26.8, 23.64, 23.02)):
        proof.estimates[run.key] = (peak, "at the optimizer step")
    proof.device_memory_gib = 79.2  # an H100: two at a time
    assert [len(part) for part in proof.side_by_side(runs)] == [2, 2]
    proof.device_memory_gib = 139.8  # an H200: all four
    assert [len(part) for part in proof.side_by_side(runs)] == [4]
    proof.estimates[runs[1].key] = "no estimate: ..."
    assert [len(part) for part in proof.side_by_side(runs)] == [1, 1, 2]
