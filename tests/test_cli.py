"""The command line answers --help and --cfg without importing torch, and the package ships its configs."""

import subprocess
import sys
import textwrap

import pytest
from helpers import run_cli


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
    result = run_cli("--cfg", "job", "strategy=ddp", "hardware.nproc_per_node=2", "strategy.bucket_cap_mb=-5",
                     cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip() == "run: error: strategy.bucket_cap_mb=-5 must be > 0"
    assert result.stdout == ""
    assert not (workdir / "outputs").exists()


def test_help_does_not_import_torch(workdir):
    probe = 'import sys; sys.argv = ["run", "--help"]; from runner.cli.main import main; main(); print("torch" in sys.modules)'
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True)
    assert result.stdout.strip().endswith("False")


@pytest.mark.slow
def test_installed_package_carries_conf_and_recipes(tmp_path):
    """`pip install .` (not editable) gives a runner that works outside the repository."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(repo)],
        capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    for source, shipped in (("conf", "conf"), ("recipes", "recipes")):
        expected = {p.relative_to(repo / source) for p in (repo / source).rglob("*.yaml")}
        assert {p.relative_to(target / "runner" / shipped) for p in (target / "runner" / shipped).rglob("*.yaml")} == expected
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "runner", "recipe=cpu_quick", "--cfg", "job"], cwd=elsewhere,
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "max_steps: 30" in result.stdout
