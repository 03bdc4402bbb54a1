"""The command line answers --help and --cfg without importing torch, and the package ships its configs."""

import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO
from tests.support.command import run_cli


def test_help_lists_groups_and_options(workdir):
    result = run_cli("--help", cwd=workdir)
    assert result.returncode == 0
    for group in ("hardware", "strategy", "precision", "tracker", "model", "data", "optim", "scheduler", "recipe"):
        assert f"\n  {group} " in result.stdout
    assert "*single" in result.stdout and "*python_stdlib" in result.stdout and "cpu_quick" in result.stdout


def test_cfg_job_prints_the_resolved_spec_without_torch(workdir):
    probe = textwrap.dedent(
        """
        import sys
        sys.argv = ["run", "--cfg", "job", "train.max_steps=7"]
        from runner.cli.main import main
        main()
        print("torch imported:", "torch" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "max_steps: 7" in result.stdout
    assert "${" not in result.stdout  # interpolations such as the corpus path are resolved
    assert "torch imported: False" in result.stdout
    # The spec that would run: the machine's hardware filled in, under the options it was composed from.
    assert "accelerator: cpu" in result.stdout and "nproc_per_node: 1" in result.stdout
    assert "accelerator: auto" not in result.stdout
    assert result.stdout.startswith("# hardware=auto strategy=single precision=fp32")


def test_cfg_job_refuses_what_the_run_would_refuse(workdir):
    result = run_cli(
        "--cfg", "job", "strategy=ddp", "hardware.nproc_per_node=2", "strategy.bucket_cap_mb=-5", cwd=workdir
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "run: error: strategy.bucket_cap_mb=-5 must be > 0"
    assert result.stdout == ""
    assert not (workdir / "outputs").exists()


def test_help_does_not_import_torch(workdir):
    probe = (
        'import sys; sys.argv = ["run", "--help"]; from runner.cli.main import main; main(); '
        'print("torch" in sys.modules)'
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True)
    assert result.stdout.strip().endswith("False")


def in_a_new_interpreter(cwd, *parts: str) -> str:
    probe = "".join(textwrap.dedent(part) for part in parts)
    result = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


COUNT_COLLECTIONS = """
    import gc
    collections = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
"""


def test_the_collector_pauses_once_and_leaves_a_disabled_collector_disabled(workdir):
    stdout = in_a_new_interpreter(
        workdir,
        COUNT_COLLECTIONS,
        """
        import os
        from runner.framework_imports import collector_paused
        collections.clear()
        with collector_paused():
            paused = not gc.isenabled()
            garbage = []
            for _ in range(100_000):
                garbage.append([garbage])
            inside = len(collections)
        print("first:", paused, inside, gc.isenabled(), gc.get_freeze_count() > 0)
        frozen = gc.get_freeze_count()
        with collector_paused():
            print("then:", gc.isenabled(), gc.get_freeze_count() == frozen)
        if os.fork() == 0:  # a forked process is frozen already: the collector stays on
            with collector_paused():
                print("forked:", gc.isenabled(), flush=True)
            os._exit(0)
        os.wait()
    """,
    )
    assert stdout.splitlines() == ["first: True 0 True True", "then: True True", "forked: True"]
    stdout = in_a_new_interpreter(
        workdir,
        """
        import gc
        from runner.framework_imports import collector_paused
        gc.disable()
        with collector_paused():
            pass
        print("disabled:", gc.isenabled(), gc.get_freeze_count() > 0)
    """,
    )
    assert stdout.strip() == "disabled: False True"


@pytest.mark.slow
def test_a_jobs_checks_import_torch_and_transformers_without_a_collection(workdir):
    """A task's checks before launch are where `run` and a cluster job's tasks first import the frameworks."""
    stdout = in_a_new_interpreter(
        workdir,
        COUNT_COLLECTIONS,
        """
        import sys
        from pathlib import Path
        from runner.cli.app import task_checked, validated
        from runner.cli.compose import compose_config
        spec = validated(compose_config(["train.max_steps=7"]), Path.cwd())
        collections.clear()
        task_checked(spec)
        print("transformers.modeling_utils" in sys.modules, collections, gc.isenabled(), gc.get_freeze_count() > 0)
    """,
    )
    assert stdout.strip() == "True [] True True"


@pytest.mark.slow
def test_installed_package_carries_conf_and_recipes(tmp_path):
    """`pip install .` (not editable) gives a runner that works outside the repository."""
    repo = REPO
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(repo)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    for source, shipped in (("conf", "conf"), ("recipes", "recipes")):
        expected = {p.relative_to(repo / source) for p in (repo / source).rglob("*.yaml")}
        assert {
            p.relative_to(target / "runner" / shipped) for p in (target / "runner" / shipped).rglob("*.yaml")
        } == expected
    assert (target / "runner" / "planning" / "measured_mfu.yaml").exists()  # the plan's table of GPU figures
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-m", "runner", "recipe=cpu_quick", "--cfg", "job"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "max_steps: 30" in result.stdout
