"""A run's time and cost before it starts (runner/planning/time_plan.py): the work counted from the spec, the FLOP
rate from the user's own past run on the same hardware, else the runner's measured table, else the default; the
prediction kept in the run's summary beside what happened. How close the prediction comes is measured by
bench/plan_accuracy.py (docs/planning.md): a test does not depend on this machine's speed."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from runner.config.spec import validate
from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import run_dirs
from tests.support.specs import composed


def planned(*overrides):
    from runner.planning.time_plan import plan

    spec = validate(composed(list(overrides)), on_this_machine=False)
    return spec, plan(spec)


def test_the_work_is_counted_from_the_spec(tmp_path):
    """Llama-3-8B: 6 FLOPs per parameter and token, plus attention's 12 x layers x width x sequence; the steps'
    tokens at full length, and a forward (a third) over each evaluation's rows."""
    spec, found = planned(
        "model=llama3_8b",
        "hardware=h100_80gb",
        "precision=bf16",
        "data.seq_len=2048",
        "train.max_steps=100",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=8",
        "train.eval_every=50",
        "train.eval_batches=2",
        f"hardware.measured_runs={tmp_path}",
    )
    per_token = 6 * 8_030_261_248 + 12 * 32 * 4096 * 2048
    step_tokens = 4 * 8 * 2048
    eval_tokens = 4 * 2 * 4 * 2048  # before the first step, at 50 and at 100 (the last)
    assert found.tokens == 100 * step_tokens
    assert found.flops == pytest.approx(per_token * (100 * step_tokens + eval_tokens / 3))


def test_adapters_do_not_count_the_frozen_weights_gradients(tmp_path):
    from runner.memory.model_shapes import facts_of
    from runner.memory.parameters import parameters_of
    from runner.planning.time_plan import flops_per_token

    spec, _ = planned("model=llama3_8b", "adapter=lora", "hardware=h100_80gb", "precision=bf16")
    full, _ = planned("model=llama3_8b", "hardware=h100_80gb", "precision=bf16")
    trained = parameters_of(spec, facts_of(spec.model)).trained
    attention = 12 * 32 * 4096 * spec.data.seq_len
    assert flops_per_token(spec) == 6 * trained + 4 * 8_030_261_248 + attention
    assert flops_per_token(full) == 6 * 8_030_261_248 + attention


@pytest.mark.parametrize("compiled", [True, False])
def test_an_h200_takes_the_measured_figure_and_the_cost_follows_the_gpu_hours(compiled, tmp_path):
    _, found = planned(
        "model=llama3_2_1b",
        "hardware=h100_80gb",
        "hardware.device_name=NVIDIA H200",
        "hardware.peak_bf16_tflops=989",
        "hardware.nproc_per_node=8",
        "strategy=fsdp",
        "precision=bf16",
        f"train.compile={str(compiled).lower()}",
        "hardware.cost_per_gpu_hour=3.5",
        f"hardware.measured_runs={tmp_path}",
    )
    mfu = 0.373 if compiled else 0.299
    assert found.rate.flops_per_s == pytest.approx(mfu * 989e12 * 8)
    assert f"{mfu:.1%} MFU, the runner's figure for Llama-3.2-1B's shapes, bf16, " in found.rate.source
    assert found.gpu_hours == pytest.approx(found.wall_s * 8 / 3600)
    line = found.line()
    assert f"{found.gpu_hours:,.3g} GPU-hours, ${found.gpu_hours * 3.5:,.2f} (at " in line


def test_the_gpu_proofs_figures_go_to_the_table_in_place_of_its_gpus_own_and_the_plan_takes_them(tmp_path, monkeypatch):
    """bench/gpu_proof.py's bf16 figures for an H100, put in a copy of the shipped table twice (a second proof
    replaces the first's rows): the H200's rows stay, and a plan on an H100 takes the H100's."""
    from runner.planning import time_plan

    table = tmp_path / "measured_mfu.yaml"
    table.write_text(time_plan.MEASURED_MFU.read_text())
    h100 = "NVIDIA H100 80GB HBM3"
    time_plan.record_measured_mfu(table, h100, {False: 0.31, True: 0.45}, "Llama-3.2-1B's shapes", "2026-12-01")
    time_plan.record_measured_mfu(table, h100, {False: 0.32, True: 0.41}, "Llama-3.2-1B's shapes", "2026-12-02")
    rows = time_plan.measured_mfu(table)
    assert [(row["device"], row["compile"], row["mfu"]) for row in rows] == [
        ("NVIDIA H200", True, 0.373),
        ("NVIDIA H200", False, 0.299),
        (h100, True, 0.41),
        (h100, False, 0.32),
    ]
    assert table.read_text().startswith("# The share of a GPU's dense bf16 peak (MFU)")
    monkeypatch.setattr(time_plan, "MEASURED_MFU", table)
    _, found = planned(
        "model=llama3_2_1b",
        "hardware=h100_80gb",
        "precision=bf16",
        "train.compile=true",
        f"hardware.measured_runs={tmp_path}",
    )
    assert found.rate.flops_per_s == pytest.approx(0.41 * 989e12)
    assert found.rate.source == (
        f"41.0% MFU, the runner's figure for Llama-3.2-1B's shapes, bf16, compiled; {h100}, 2026-12-02"
    )


def test_hardware_without_a_figure_takes_the_default_and_without_a_peak_has_no_time(tmp_path):
    _, default = planned("hardware=rtx4090", "precision=bf16", f"hardware.measured_runs={tmp_path}")
    assert default.rate.source == "30% MFU, the default: no figure measured for this hardware"
    _, unknown = planned("hardware=cpu", f"hardware.measured_runs={tmp_path}")
    assert not unknown.known and "the time is unknown" in unknown.line()


@pytest.mark.slow  # trains two runs
def test_a_finished_run_calibrates_the_plan_of_the_next_on_the_same_hardware(workdir):
    """The default job's first run has no time to predict on a CPU; its summary records the FLOP rate it reached,
    which task=estimate, and the next run's start, use; its summary holds that prediction beside its own time."""
    first = run_cli("hardware=cpu", "train.max_steps=6", "train.eval_every=0", "train.eval_batches=1", cwd=workdir)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "the time is unknown" in first.stdout
    [calibration] = run_dirs(workdir)
    reached = json.loads((calibration / "summary.json").read_text())
    assert reached["achieved_tflops"] > 0 and reached["identity"]["processes"] == 1 and reached["mfu"] is None

    estimate = run_cli("task=estimate", "hardware=cpu", "data.seq_len=128", "train.max_steps=12", cwd=workdir)
    assert estimate.returncode == 0, estimate.stderr
    [line] = [line for line in estimate.stdout.splitlines() if line.startswith("time: ")]
    assert f"measured by your run {calibration}" in line and "12 steps, at most 12,288 tokens" in line
    rate = float(re.search(r"at ([\d.e+-]+) TFLOP/s", line).group(1))
    assert rate == pytest.approx(reached["achieved_tflops"], rel=1e-2)

    second = run_cli(
        "hardware=cpu",
        "data.seq_len=128",
        "train.max_steps=12",
        "train.eval_every=0",
        "train.eval_batches=1",
        cwd=workdir,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    [run_dir] = [run for run in run_dirs(workdir) if run != calibration]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["predicted"]["rate_source"] == f"measured by your run {calibration}"
    assert summary["predicted"]["wall_time_s"] > 0 and summary["wall_time_s"] > 0
    other = run_cli("task=estimate", "hardware=cpu", "strategy=ddp", "hardware.nproc_per_node=2", cwd=workdir)
    assert "the time is unknown" in other.stdout  # two processes under DDP: not the hardware the runs measured


def test_runs_of_two_step_sizes_fit_a_fixed_part_of_a_step_and_a_part_per_flop(tmp_path):
    """The per-step overhead a tiny model on a CPU pays besides its FLOPs, told apart by two past runs of two step
    sizes (their summaries written here, so that no test depends on this machine's speed)."""
    from runner.planning.time_plan import flops_per_token, hardware_identity, plan, step_tokens

    spec = validate(composed(["hardware=cpu", f"hardware.measured_runs={tmp_path}"]))
    step_flops = flops_per_token(spec) * step_tokens(spec)
    for name, flops in (("small", step_flops / 2), ("large", 2 * step_flops)):
        (tmp_path / name).mkdir()
        summary = {
            "identity": hardware_identity(spec),
            "flops_per_step": flops,
            "step_time_s": 0.01 + flops * 1e-12,
            "steps": 30,
            "wall_time_s": 30 * (0.01 + flops * 1e-12) + 2.0,
            "run_dir": str(tmp_path / name),
        }
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    found = plan(spec)
    assert found.rate.source.startswith("fitted to your 2 runs on this hardware, the nearest ")
    assert found.rate.per_step_s == pytest.approx(0.01) and found.rate.per_flop_s == pytest.approx(1e-12)
    assert found.step_s == pytest.approx(0.01 + step_flops * 1e-12) and found.rate.overhead_s == pytest.approx(2.0)


PAIRS = DATA / "llama_factory" / "dpo_en_demo.json"
PROMPTS = DATA / "gsm8k" / "test_head.jsonl"


@pytest.mark.parametrize(
    "task, passes",
    [
        (["task=dpo", "data=preference_files", f"data.files={PAIRS}"], 1),  # the reference's log-probs
        (["task=dpo", "data=preference_files", f"data.files={PAIRS}", "task.loss=simpo"], 0),  # no reference
        (["task=grpo", "data=prompt_files", f"data.files={PROMPTS}"], 1),  # sampling
        # sampling, the sampling policy's and the reference's log-probs, for two steps
        (["task=grpo", "data=prompt_files", f"data.files={PROMPTS}", "task.num_iterations=2", "task.beta=0.1"], 1.5),
    ],
)
def test_post_training_counts_its_forward_passes_and_only_its_own_past_runs(task, passes, tmp_path):
    """A forward pass over a step's rows besides the trained one (DPO's reference, GRPO's sampling and log-probs)
    adds a third of the step's work; a past run of another kind of step (here next-token training, with the same
    step size) does not stand for its rate."""
    from runner.planning.time_plan import flops_per_token, hardware_identity, step_flops, step_tokens

    common = [
        "hardware=cpu",
        "train.max_steps=10",
        "train.eval_every=0",
        "train.eval_batches=1",
        f"hardware.measured_runs={tmp_path}",
    ]
    trained, _ = planned(*common)
    spec, found = planned(*common, *task)
    assert step_flops(spec) == pytest.approx(flops_per_token(spec) * step_tokens(spec) * (1 + passes / 3))
    assert found.flops == pytest.approx(10 * step_flops(spec) + flops_per_token(spec) * step_tokens(spec) * 2 / 3)
    summary = {
        "identity": hardware_identity(trained),
        "flops_per_step": step_flops(trained),
        "step_time_s": 0.1,
        "steps": 10,
        "wall_time_s": 2.0,
        "run_dir": str(tmp_path / "trained"),
    }
    (tmp_path / "trained").mkdir()
    (tmp_path / "trained" / "summary.json").write_text(json.dumps(summary))
    assert planned(*common)[1].known and not planned(*common, *task)[1].known


def test_post_training_estimate_only_prints_its_time(workdir):
    result = run_cli(
        "task=dpo",
        "data=preference_files",
        f"data.files={PAIRS}",
        "task.estimate_only=true",
        "hardware.peak_bf16_tflops=100",
        "train.max_steps=7",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("time: ")]
    assert line.startswith("time: 7 steps, ") and "30% MFU, the default" in line
    assert not (workdir / "outputs").exists()


def test_each_scoring_of_the_benchmarks_is_a_forward_of_their_tokens(tmp_path):
    """Scored at steps 4 and 8 and after the last (10); task=estimate, which does not load them, says so."""
    from runner.planning.time_plan import flops_per_token, plan

    spec, without = planned(
        "hardware=h100_80gb",
        "train.max_steps=10",
        "train.benchmarks=[local_copa]",
        "train.benchmark_every=4",
        f"hardware.measured_runs={tmp_path}",
    )
    counted = plan(spec, benchmark_tokens=1000)
    assert counted.flops - without.flops == pytest.approx(3 * 1000 * flops_per_token(spec) / 3)
    assert counted.wall_s > without.wall_s
    assert without.line().endswith("; the benchmarks' forwards are not counted")
    assert not counted.line().endswith("not counted")


def test_a_negative_price_is_refused_in_one_line(workdir):
    result = run_cli("hardware.cost_per_gpu_hour=-1", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr == "run: error: hardware.cost_per_gpu_hour=-1.0 must be >= 0 (0: no cost shown)\n"


def a_plan(wall_s, processes=8, cost_per_gpu_hour=0.0, known=True):
    from runner.planning.time_plan import Rate, TimePlan

    rate = Rate(1e-15 if known else 0.0, "a stated rate")
    return TimePlan(100, 1000, 1e15, rate, wall_s / 100, wall_s, processes, cost_per_gpu_hour)


def test_a_plan_past_the_time_limit_takes_a_requeue_per_limit_less_the_warning():
    """Each submission trains until SLURM's warning, signal_delay_s before the limit, when the job checkpoints and
    requeues itself: 2 h in 60 min submissions is one requeue without a warning, two with a 90 s one."""
    from runner.planning.time_plan import requeue_line

    assert requeue_line(a_plan(7200), 60) == (
        "time limit: about 2.0 h passes the 60.0 min of hydra.launcher.timeout_min=60: about 1 requeue, each resuming "
        "from the last checkpoint (set train.checkpoint_every so that little is trained again)"
    )
    assert requeue_line(a_plan(7200), 60, warning_s=90) == (
        "time limit: about 2.0 h passes the 60.0 min of hydra.launcher.timeout_min=60: about 2 requeues, each "
        "resuming from the checkpoint the job writes at SLURM's warning, 90 s before the limit "
        "(hydra.launcher.signal_delay_s)"
    )
    assert requeue_line(a_plan(3510), 60, warning_s=90) is None  # trained to its end before the warning
    assert "about 1 requeue," in requeue_line(a_plan(3520), 60, warning_s=90)
    assert requeue_line(a_plan(3520), 60) is None
    assert requeue_line(a_plan(10**6, known=False), 60) is None  # no time known: nothing to say


def test_a_sweeps_total_sums_its_jobs_time_gpu_hours_and_the_cost_where_a_price_is_set():
    from runner.planning.time_plan import sweep_line

    plans = [a_plan(3600, 8, 2.0), a_plan(1800, 8, 2.0), a_plan(720, 1)]
    # 102 min; 8 + 4 + 0.2 GPU-hours; $16 + $8, the third job unpriced
    assert sweep_line(plans) == (
        "sweep: 3 jobs, about 102.0 min one after another, 12.2 GPU-hours, $24.00 for the 2 "
        "jobs with a hardware.cost_per_gpu_hour"
    )
    assert sweep_line(plans[:2]) == "sweep: 2 jobs, about 90.0 min one after another, 12 GPU-hours, $24.00"
    assert sweep_line([*plans, a_plan(60, known=False)]).startswith("sweep: 4 jobs; 1 of them have no known time")


@pytest.mark.slow
def test_an_estimate_past_its_cluster_time_limit_says_how_many_requeues_it_takes(workdir):
    """Hydra's submitit launcher's time limit (hydra.launcher.timeout_min, less its signal_delay_s warning) against
    each job's predicted time: 2.1 and 4.2 hours of an 8-GPU Llama-3-8B run at the default MFU take 2 and 4 requeues
    of an hour; none within 10 h. A single estimate composed with the launcher says it too; planning needs no sbatch
    (this machine's PATH holds none here)."""
    from runner.planning.time_plan import plan, requeue_line

    job = ["task=estimate", "model=llama3_8b", "strategy=fsdp", "hardware=8xh100_80gb", "precision=bf16"]

    def planned_for(steps):
        return plan(
            validate(composed([*job, f"train.max_steps={steps}"]), on_this_machine=False), runs_dir=workdir / "outputs"
        )

    planned = planned_for(20000)
    assert planned.wall_s == pytest.approx(2.1 * 3600, rel=0.05)
    assert "about 2 requeues" in requeue_line(planned, 60, 90) and requeue_line(planned, 600, 90) is None
    no_slurm = {"PATH": str(workdir)}
    result = run_cli(
        "-m",
        *job,
        "train.max_steps=20000,40000",
        "hydra/launcher=slurm",
        "hydra.launcher.timeout_min=60",
        cwd=workdir,
        env=no_slurm,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    limits = [line for line in result.stdout.splitlines() if line.startswith("time limit: ")]
    assert limits == [requeue_line(planned, 60, 90), requeue_line(planned_for(40000), 60, 90)], result.stdout
    assert "about 4 requeues" in limits[1]
    single = run_cli(
        *job,
        "train.max_steps=20000",
        "hydra/launcher=slurm",
        "hydra.launcher.timeout_min=60",
        cwd=workdir,
        env=no_slurm,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    time_line, limit_line = single.stdout.strip().splitlines()[-2:]
    assert time_line == planned.line() and limit_line == limits[0]


def test_cfg_job_of_an_estimate_sweep_prints_the_specs_without_plans_or_torch(workdir):
    """`run --cfg job -m task=estimate ...` prints each point's spec; the plans, which read the model's facts, are
    task=estimate's."""
    probe = textwrap.dedent(
        """
        import sys
        sys.argv = ["run", "--cfg", "job", "-m", "task=estimate", "strategy=ddp,fsdp", "hardware.nproc_per_node=2",
                    "hardware.peak_bf16_tflops=10"]
        from runner.cli.main import main
        main()
        print("torch imported:", "torch" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n# hardware=auto strategy=") == 2
    assert "time: " not in result.stdout and "sweep: " not in result.stdout
    assert "torch imported: False" in result.stdout


@pytest.mark.parametrize("model", ["qwen3_30b_a3b", "mixtral_8x7b"])
def test_a_moe_model_counts_its_active_parameters(model, tmp_path):
    """6 FLOPs per active parameter, counted here from the config's numbers alone: the embeddings, the LM head,
    and per layer the attention, two norms, the router and k of the experts (a gated MLP each); Qwen3-MoE
    normalises each head's q and k."""
    import yaml

    from runner.cli.compose import CONF_DIR
    from runner.planning.time_plan import flops_per_token

    config = yaml.safe_load((CONF_DIR / "model" / f"{model}.yaml").read_text())["architecture"]
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    experts, k = config.get("num_experts") or config["num_local_experts"], config["num_experts_per_tok"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    attention = h * q + 2 * h * kv + q * h + (2 * head_dim if config["model_type"] == "qwen3_moe" else 0)
    per_layer = attention + 2 * h + experts * h + k * 3 * h * width
    active = 2 * vocab * h + h + layers * per_layer
    spec, _ = planned(f"model={model}", "hardware=h100_80gb", "precision=bf16", f"hardware.measured_runs={tmp_path}")
    assert flops_per_token(spec) == 6 * active + 12 * layers * h * spec.data.seq_len
