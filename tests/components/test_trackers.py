"""Each tracker's record of a real short run, read back with the tracker's own reader, matches metrics.jsonl."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import run_dirs
from tests.support.specs import QUICK

pytestmark = pytest.mark.slow

ARGS = [
    *QUICK,
    "train.max_steps=6",
    "train.log_every=2",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.micro_batch_size=4",
]
LOGGED = {"loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "peak_memory_gib"}
# A benchmark scored at steps 3 and 6 (tests/generation/test_benchmarks.py checks its scores): each score is a metric.
BENCHMARK = str(DATA / "benchmarks" / "copa_loglikelihood.yaml")
SCORED = {"bench/copa_loglikelihood/acc", "bench/copa_loglikelihood/perplexity"}


def jsonl_steps(run_dir: Path, key: str) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if key in r]


def wandb_records(run_dir: Path) -> list[dict]:
    """Every record of the run's offline .wandb file, as wandb's own `leet inspect` prints them."""
    [path] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def each_tracker_logged(run_dir: Path, names: list[str], monkeypatch) -> None:
    """wandb (offline), TensorBoard and MLflow, each read back by its own reader, logged each of `names` at the
    steps metrics.jsonl has it: every step (1, 2) and, an eval_ metric, the evaluations (0, 2)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run_dir / "mlruns").as_uri())
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    history = [r["history"] for r in wandb_records(run_dir) if r.get("type") == "history"]
    for name in names:
        expected = jsonl_steps(run_dir, name)
        assert expected == ([0, 2] if name.startswith("eval_") else [1, 2]), name
        assert [e.step for e in events.Scalars(name)] == expected, name
        assert [m.step for m in client.get_metric_history(run_id, name)] == expected, name
        assert sorted({int(h["step"].get("num", 0)) for h in history if name in h["item"]}) == expected, name


def wandb_summary(run_dir: Path) -> dict:
    [path] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("tracked")
    result = run_cli(
        *ARGS,
        "tracker=[wandb,tensorboard,mlflow]",
        f"train.benchmarks=[{BENCHMARK}]",
        "train.benchmark_limit=4",
        "train.benchmark_every=3",
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb:" not in result.stdout + result.stderr  # the trackers keep quiet
    return run_dirs(cwd)[0]


def test_wandb_offline_run_matches_metrics_jsonl(tracked):
    history = [r["history"] for r in wandb_records(tracked) if r.get("type") == "history"]
    for key in (*LOGGED, *SCORED, "eval_loss"):
        logged = sorted({int(h["step"].get("num", 0)) for h in history if key in h["item"]})
        assert logged == sorted(set(jsonl_steps(tracked, key))), key  # a step's records: one row of wandb's
    summary = wandb_summary(tracked)
    assert summary["state"] == "finished"
    assert summary["config"]["train"]["max_steps"] == 6
    assert summary["config"]["precision_in_effect"]["master_weights"] == "fp32"


def test_tensorboard_events_match_metrics_jsonl(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in (*LOGGED, *SCORED, "eval_loss"):
        assert [e.step for e in events.Scalars(key)] == jsonl_steps(tracked, key), key


def test_mlflow_run_matches_metrics_jsonl(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a directory store behind this switch
    client = MlflowClient((tracked / "mlruns").as_uri())
    run = client.get_run((tracked / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"{tracked.parent.name}/{tracked.name}"
    assert run.data.params["train.max_steps"] == "6"
    assert run.data.params["precision_in_effect.forward"] == "fp32"
    for key in (*LOGGED, *SCORED, "eval_loss"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == jsonl_steps(tracked, key), key


def test_api_keys_appear_in_no_file_of_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "env-secret-0123456789")
    result = run_cli(
        *ARGS, "tracker=[wandb,tensorboard,mlflow]", "tracker.wandb.api_key=spec-secret-9876543210", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path)
    leaks = [
        p
        for p in run_dir.rglob("*")
        if p.is_file() and any(s in p.read_bytes() for s in (b"env-secret-0123456789", b"spec-secret-9876543210"))
    ]
    assert leaks == []
    assert "api_key: <redacted>" in (run_dir / "spec.yaml").read_text()


def test_a_sweep_makes_one_finished_wandb_run_per_job_in_one_group(tmp_path):
    result = run_cli("-m", *ARGS, "tracker=wandb", "seed=0,1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p.parent for p in tmp_path.glob("outputs/multirun/*/*/*/summary.json"))
    assert len(jobs) == 2
    groups = set()
    for job in jobs:
        [run] = [r["run"] for r in wandb_records(job) if r.get("type") == "run"]
        groups.add(run["run_group"])
        assert run["display_name"].endswith(f"seed={jobs.index(job)}")
        assert wandb_summary(job)["state"] == "finished"
    assert groups == {str(jobs[0].parent.relative_to(tmp_path))}  # the sweep directory


def test_a_terminal_gets_a_progress_bar_and_mfu_where_the_peak_is_known(tmp_path):
    """On a terminal: a bar with loss and tokens/s above which the log lines still print."""
    import os
    import pty

    controller, terminal = pty.openpty()
    job = subprocess.Popen(
        [sys.executable, "-m", "runner", *ARGS, "hardware.peak_bf16_tflops=0.001"],
        cwd=tmp_path,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        close_fds=True,
    )
    os.close(terminal)
    screen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the run is over
            break
        if not chunk:
            break
        screen += chunk
    assert job.wait(timeout=60) == 0
    text = screen.decode(errors="replace")
    assert "6/6" in text and "tokens_per_s=" in text and "loss=" in text  # the bar
    assert "done: train loss" in text  # the log lines
    # The bar's tokens/s ends where the done line's is: both the mean of the training steps.
    done = text.split("done: train loss", 1)[1].split(" tokens/s (mean of the training steps)")[0].rsplit(" ", 1)[1]
    assert f"tokens_per_s={done}" in text
    [run_dir] = run_dirs(tmp_path)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu"] for r in records if "loss" in r)


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    first = run_cli(*ARGS, "tracker=[wandb,mlflow]", "train.checkpoint_every=3", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path)
    again = run_cli(f"resume={run_dir}", "train.max_steps=8", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run_dir / "mlruns").as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "runner"]
    [run] = client.search_runs([experiment.experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4, 6, 8]
    wandb_ids = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(wandb_ids) == 1  # both parts log to one wandb run, which `wandb sync` joins


# ---- trackers checked before launch: one line, exit 2, a bounded wait, nothing written


def test_wandb_online_without_an_api_key_is_refused_before_launch(workdir):
    env = {"WANDB_API_KEY": "", "NETRC": str(workdir / "no-netrc")}
    result = run_cli("tracker=wandb", "tracker.wandb.mode=online", cwd=workdir, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "tracker.wandb.mode=online needs a W&B API key: set WANDB_API_KEY" in result.stderr
    assert not (workdir / "outputs").exists()


def test_an_mlflow_server_that_does_not_answer_is_refused_within_seconds(workdir):
    import socket
    import time

    from runner.components.tracker_services import WAIT_S

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # accepts connections, never answers
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
    try:
        for sock, why in ((silent, f"no answer within {WAIT_S:g} s"), (refused, "Connection refused")):
            uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
            started = time.monotonic()
            result = run_cli("tracker=mlflow", f"tracker.mlflow.tracking_uri={uri}", cwd=workdir)
            assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
            assert f"tracker.mlflow.tracking_uri={uri} does not answer ({why}" in result.stderr
            assert time.monotonic() - started < WAIT_S + 30
            assert not (workdir / "outputs").exists()
    finally:
        silent.close()
        refused.close()


def test_an_mlflow_server_that_answers_its_health_check_passes():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from runner.components.trackers import check_mlflow_service
    from runner.config.tracker import MLflowConfig

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check_mlflow_service(MLflowConfig(tracking_uri=f"http://127.0.0.1:{server.server_port}"))
    finally:
        server.shutdown()
