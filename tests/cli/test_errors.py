"""Bad input ends in one line on stderr, a non-zero exit, and no output directory."""

import json
from pathlib import Path

import pytest

from tests.support import DATA
from tests.support.command import run_cli

TRL_PAIRS = DATA / "trl" / "preference_standard.jsonl"
BAD_INPUTS = {
    "unknown key": (["strategy.shardng=x"], "unknown key strategy.shardng"),
    "unknown key added with +": (["+optim.foo=1"], "unknown key optim.foo"),
    "unknown top-level key": (["+foo=1"], "unknown key foo"),
    "unknown option": (["strategy=zero9"], "strategy=zero9 is not an option"),
    "unknown precision": (
        ["precision=fp9"],
        "precision=fp9 is not an option; choose one of: bf16, fp16, fp32, fp8, pure_bf16",
    ),
    "wrong type": (["optim.lr=abc"], "optim.lr: Value 'abc'"),
    "out of range": (["train.max_steps=-3"], "train.max_steps=-3 must be a positive integer"),
    "more processes than the strategy runs": (["hardware.nproc_per_node=2"], "strategy=single runs one process"),
    "hardware this machine lacks": (["hardware=h100_80gb"], "CUDA"),
    "missing data path": (["data.files=/no/such/dir/*.txt"], "data.files=/no/such/dir/*.txt matches no file"),
    "missing model directory": (["model=pretrained", "model.pretrained=./no-such-model"], "is not a directory"),
    "bad sweep point": (["-m", "train.max_steps=5,-1"], "train.max_steps=-1 must be a positive integer"),
    "bad override syntax": (["train.max_steps=[1"], "train.max_steps=[1"),
    "deepspeed key given to fsdp": (
        ["strategy=fsdp", "strategy.zero_stage=3"],
        "strategy.zero_stage is a key of strategy=deepspeed, not of strategy=fsdp",
    ),
    "fsdp key given to deepspeed": (
        ["strategy=deepspeed", "strategy.sharding_strategy=FULL_SHARD"],
        "strategy.sharding_strategy is a key of strategy=fsdp, not of strategy=deepspeed",
    ),
    "tensor parallelism under deepspeed": (
        ["strategy=deepspeed", "strategy.tp_size=2", "hardware.nproc_per_node=2"],
        "strategy.tp_size is a key of strategy=fsdp, not of strategy=deepspeed",
    ),
    "tensor parallelism that does not divide a node": (
        ["strategy=fsdp", "strategy.tp_size=3", "hardware.nproc_per_node=4"],
        "strategy.tp_size=3 does not divide a node's 4 processes",
    ),
    "tensor parallelism that does not divide the heads": (
        [
            "strategy=fsdp",
            "strategy.tp_size=2",
            "hardware.nproc_per_node=2",
            "model.architecture.num_key_value_heads=1",
        ],
        "strategy.tp_size=2 does not divide the model's 4 attention heads and 1 key-value heads",
    ),
    "hybrid groups that do not divide the data-parallel ranks": (
        [
            "strategy=fsdp",
            "strategy.tp_size=2",
            "hardware.nproc_per_node=4",
            "strategy.sharding_strategy=HYBRID_SHARD",
            "strategy.hybrid_shard_size=4",
        ],
        "strategy.hybrid_shard_size=4 does not divide the 2 data-parallel ranks",
    ),
    "QLoRA under tensor parallelism": (
        ["strategy=fsdp", "strategy.tp_size=2", "hardware.nproc_per_node=2", "adapter=qlora"],
        "adapter=qlora with strategy.tp_size=2: torchao's NF4 weights do not split",
    ),
    "float8 all-gather under tensor parallelism": (
        [
            "strategy=fsdp",
            "strategy.tp_size=2",
            "hardware.nproc_per_node=2",
            "precision=fp8",
            "precision.fp8.emulate=true",
            "precision.fp8.all_gather=true",
        ],
        "precision.fp8.all_gather=true with strategy.tp_size=2: FSDP's float8 all-gather scales each weight from its "
        "data-parallel shards alone",
    ),
    "compiled blocks under tensor parallelism": (
        ["strategy=fsdp", "strategy.tp_size=2", "hardware.nproc_per_node=2", "train.compile=true"],
        "train.compile=true with strategy.tp_size=2 on cpu: torch.compile of "
        "the split blocks fails in their DTensor forward on the CPU",
    ),
    "async tensor parallelism on the CPU": (
        ["strategy=fsdp", "strategy.tp_size=2", "hardware.nproc_per_node=2", "strategy.async_tp=true"],
        "strategy.async_tp=true overlaps tensor parallelism's collectives in the "
        "compiled blocks, on CUDA: it needs strategy.tp_size > 1 (not 2), "
        "train.compile=true (not false) and CUDA GPUs (not cpu)",
    ),
    "sequence parallelism that does not divide the processes": (
        ["strategy=deepspeed", "strategy.sp_size=2", "hardware.nproc_per_node=3"],
        "strategy.sp_size=2 does not divide the 3 processes",
    ),
    "context parallelism on the CPU": (
        ["strategy=fsdp", "strategy.cp_size=2", "hardware.nproc_per_node=2"],
        "strategy.cp_size=2 needs CUDA GPUs: torch's context parallelism runs the attention's ring on CUDA's flash",
    ),
    "pipeline parallelism under deepspeed": (
        ["strategy=deepspeed", "strategy.pp_size=2", "hardware.nproc_per_node=2"],
        "strategy.pp_size is a key of strategy=fsdp, not of strategy=deepspeed",
    ),
    "pipeline stages that do not divide the processes": (
        ["strategy=fsdp", "strategy.pp_size=2", "hardware.nproc_per_node=3"],
        "strategy.pp_size=2 does not divide the 3 processes",
    ),
    "more pipeline stages than layers": (
        [
            "strategy=fsdp",
            "strategy.pp_size=2",
            "strategy.pp_schedule=Interleaved1F1B",
            "hardware.nproc_per_node=2",
            "model.architecture.num_hidden_layers=3",
            "train.grad_accum_steps=2",
        ],
        "strategy.pp_size=2 with strategy.pp_schedule=Interleaved1F1B cuts the model into 4 stages, more than its "
        "3 decoder layers",
    ),
    "a schedule with fewer micro batches than stages": (
        ["strategy=fsdp", "strategy.pp_size=2", "hardware.nproc_per_node=2"],
        "strategy.pp_schedule=1F1B with strategy.pp_size=2: 1F1B needs at least as many microbatches as stages (2), "
        "and a step has 1 (train.grad_accum_steps",
    ),
    "a schedule that is not one": (
        ["strategy=fsdp", "strategy.pp_size=2", "hardware.nproc_per_node=2", "strategy.pp_schedule=ZeroBubble"],
        "strategy.pp_schedule=ZeroBubble is not a schedule; use one of GPipe, 1F1B, Interleaved1F1B",
    ),
    "pipeline and tensor parallelism with a sequence that tp does not divide": (
        [
            "strategy=fsdp",
            "strategy.pp_size=2",
            "strategy.tp_size=2",
            "hardware.nproc_per_node=4",
            "train.grad_accum_steps=2",
            "data.seq_len=127",
        ],
        "strategy.pp_size=2 with strategy.tp_size=2: data.seq_len=127 must be a multiple of it",
    ),
    "preference training through a pipeline": (
        [
            "task=dpo",
            "data=preference_files",
            f"data.files={TRL_PAIRS}",
            "strategy=fsdp",
            "strategy.pp_size=2",
            "hardware.nproc_per_node=2",
            "train.grad_accum_steps=2",
        ],
        "task=dpo with 2 pipeline stages (strategy.pp_size)",
    ),
    "hybrid groups that do not divide the processes": (
        [
            "strategy=fsdp",
            "strategy.sharding_strategy=HYBRID_SHARD",
            "strategy.hybrid_shard_size=3",
            "hardware.nproc_per_node=4",
        ],
        "strategy.hybrid_shard_size=3 does not divide the 4 processes",
    ),
    "several nodes without a rendezvous endpoint": (
        ["strategy=ddp", "hardware.nnodes=2"],
        "needs hardware.rdzv_endpoint",
    ),
    "fp8 on a machine without it": (
        ["precision=fp8"],
        "precision=fp8 needs a GPU with fp8 tensor cores (CUDA compute capability 8.9+",
    ),
    "parameter offload below ZeRO-3": (
        ["strategy=deepspeed", "strategy.offload_param=cpu"],
        "strategy.offload_param=cpu needs strategy.zero_stage=3",
    ),
    "an architecture that cannot be built": (
        ["model.architecture.num_attention_heads=3"],
        "cannot build the model's architecture: ValueError: The hidden size "
        "(128) is not a multiple of the number of attention heads (3)",
    ),
    "an encoder to train": (["model=bert_base_cased"], "bert is not a causal language model"),
    "a run that cannot fit": (["hardware=cpu", "hardware.device_memory_gib=0.01"], "the run does not fit"),
    "a misspelt key": (
        ["train.max_step=5"],
        "unknown key train.max_step: Key 'max_step' not in 'TrainConfig'; did you mean train.max_steps?",
    ),
    "a misspelt key added with +": (["+sed=3"], "did you mean seed?"),
    "a misspelt option": (
        ["strategy=fdsp"],
        "strategy=fdsp is not an option; choose one of: ddp, deepspeed, fsdp, single; did you mean fsdp?",
    ),
    "lightning-hydra-template's experiment": (
        ["experiment=llama"],
        "unknown key experiment: experiments are recipes here: recipe=<name>",
    ),
    "lightning-hydra-template's logger": (["logger=wandb"], "loggers are trackers here: tracker=wandb"),
    "lightning-hydra-template's trainer": (
        ["+trainer.max_epochs=1"],
        "unknown key trainer: the Trainer's settings are the hardware, strategy and precision groups",
    ),
    "lightning-hydra-template's debug": (["debug=default"], "for a short debugging run: recipe=cpu_quick"),
    "a negative bucket size": (
        ["strategy=ddp", "hardware.nproc_per_node=2", "strategy.bucket_cap_mb=-5"],
        "strategy.bucket_cap_mb=-5 must be > 0",
    ),
    "a negative seed": (["seed=-5"], "seed=-5 must be >= 0"),
    "no checkpoint kept": (["train.keep_checkpoints=-1"], "train.keep_checkpoints=-1 must be >= 1"),
    "a fraction of a checkpoint": (["train.keep_checkpoints=1.5"], "train.keep_checkpoints: Value '1.5' of type"),
    "no time for a collective": (
        ["train.collective_timeout_s=0"],
        "train.collective_timeout_s=0.0 must be > 0 seconds, or null: three stall reports "
        "(train.stall_report_s), and at least 600",
    ),
    "a negative epsilon": (["optim.eps=-1e-8"], "optim.eps=-1e-08 must be >= 0"),
    "a negative device memory": (
        ["task=estimate", "hardware.device_memory_gib=-5"],
        "hardware.device_memory_gib=-5.0 must be > 0",
    ),
    "a negative peak": (["hardware.peak_bf16_tflops=-5"], "hardware.peak_bf16_tflops=-5.0 must be >= 0"),
    "a glob sweep's point": (
        ["-m", "strategy=glob(s*)", "hardware.nproc_per_node=2"],
        "strategy=single hardware.nproc_per_node=2: strategy=single runs one process",
    ),
    "a range sweep's point": (["-m", "train.max_steps=range(-2,3)"], "train.max_steps=-2 must be a positive integer"),
    "a choice sweep's point": (
        ["-m", "train.micro_batch_size=choice(4,-8)"],
        "train.micro_batch_size=-8: train.micro_batch_size=-8 must be",
    ),
    "an Optuna interval's end": (
        ["-m", "hydra/sweeper=optuna", "optim.lr=interval(-0.5,0.01)"],
        "optim.lr=-0.5: optim.lr=-0.5 must be > 0",
    ),
    "an Optuna tagged interval's end": (
        ["-m", "hydra/sweeper=optuna", "train.max_steps=tag(log,int(interval(0,9)))"],
        "train.max_steps=0 must be a positive integer",
    ),
    "an Optuna float interval for a whole number": (
        ["-m", "hydra/sweeper=optuna", "train.max_steps=interval(1,9)"],
        "could not be converted to Integer",
    ),
    "an endpoint without a port": (
        ["strategy=ddp", "hardware.nnodes=2", "hardware.rdzv_endpoint=node0"],
        "hardware.rdzv_endpoint=node0 must be <host of node 0>:<port>",
    ),
    "no time to wait at the rendezvous": (
        ["strategy=ddp", "hardware.nnodes=2", "hardware.rdzv_endpoint=node0:29500", "hardware.rdzv_timeout_s=0"],
        "hardware.rdzv_timeout_s=0 must be >= 1",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(case, workdir):
    args, expected = BAD_INPUTS[case]
    result = run_cli(*args, cwd=workdir)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("run: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (workdir / "outputs").exists()


def test_data_that_rules_the_job_out_leaves_no_run_directory(workdir):
    (workdir / "pairs.jsonl").write_text(json.dumps({"prompt": "2+2=", "response": "4"}) + "\n")
    result = run_cli("data=instruction_files", "data.files=pairs.jsonl", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"run: error: data.files={workdir / 'pairs.jsonl'} holds 1 document(s); training and evaluation need at least 2"
    ]
    assert not (workdir / "outputs").exists()


@pytest.mark.parametrize(
    "name,content,error",
    [
        (
            "pairs.jsonl",
            b'{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "2+2=", "response": 4}\n',
            "pairs.jsonl line 3 has field 'response' = 4, not a string",
        ),
        (
            "pairs.jsonl",
            b'{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2=", "response": "4"\n',
            "pairs.jsonl line 2 is not valid JSON (Expecting ',' delimiter: line 1 column 35 (char 34))",
        ),
        (
            "notes.txt",
            "caf\u00e9 au lait\n".encode("latin-1"),
            "notes.txt is not UTF-8 text (byte 0xe9 at offset 3); convert it to UTF-8 or leave it out",
        ),
        (
            "notes.txt",
            b"\x7fELF\x02\x01\x01\x00\x00",
            "notes.txt is not text (a NUL byte at offset 7: a binary file?); leave it out",
        ),
    ],
)
def test_unreadable_data_is_named_by_its_file_and_line_and_leaves_nothing(name, content, error, workdir):
    (workdir / "data").mkdir()
    (workdir / "data" / name).write_bytes(content)
    (workdir / "data" / f"more{Path(name).suffix}").write_text(
        '{"prompt": "3+3=", "response": "6"}\n' if name.endswith(".jsonl") else "more text\n"
    )
    group = "instruction_files" if name.endswith(".jsonl") else "text_files"
    result = run_cli(f"data={group}", f"data.files=data/*{Path(name).suffix}", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr == f"run: error: data.files: {workdir / 'data' / error}\n"
    assert not (workdir / "outputs").exists()


def test_data_without_the_format_column_is_named(workdir):
    (workdir / "rows.jsonl").write_text("".join(json.dumps({"body": f"row {i}"}) + "\n" for i in range(4)))
    result = run_cli("data=text_files", "data.files=rows.jsonl", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr == (
        f"run: error: data.files: {workdir / 'rows.jsonl'} line 1 has no field 'text' (it has: "
        "body); set data.text_field\n"
    )


def test_deepspeed_config_file_that_contradicts_the_spec_names_both(workdir):
    (workdir / "ds.json").write_text(json.dumps({"gradient_clipping": 0.5, "wall_clock_breakdown": True}))
    result = run_cli("strategy=deepspeed", "hardware.nproc_per_node=2", "strategy.config_file=ds.json", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "run: error: ds.json sets gradient_clipping=0.5 but the spec gives train.max_grad_norm=1.0; change one of "
        'them, or write "auto" in the file'
    ]
    assert not (workdir / "outputs").exists()


@pytest.mark.parametrize(
    "args,used",
    [
        (["hydra.run.dir=runs/a"], "runs/a/spec.yaml"),
        (["-m", "hydra.sweep.dir=runs/s", "seed=1,2"], "runs/s/0/spec.yaml"),
    ],
)
def test_a_directory_that_holds_a_run_is_not_reused(args, used, workdir):
    (workdir / used).parent.mkdir(parents=True)
    (workdir / used).write_text("# a run's spec\n")
    (workdir / used).with_name("metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    result = run_cli(*args, cwd=workdir)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert (
        f"holds a run already ({used}); choose another directory, or continue that run with: run resume="
        in result.stderr
    )
    assert (workdir / used).with_name("metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    assert sorted(p.name for p in (workdir / used).parent.iterdir()) == ["metrics.jsonl", "spec.yaml"]


def test_a_spec_file_whose_group_value_another_option_lacks_is_one_line(workdir):
    """A run's spec.yaml keeps the values it set in a group's section (here the train task's fit_check); composed
    with another option of that group, the line to remove is named."""
    (workdir / "spec.yaml").write_text(
        "defaults:\n  - config\n  - override task: train\n  - _self_\ntask:\n  fit_check: false\n"
    )
    result = run_cli("--config-dir", str(workdir), "--config-name", "spec", "task=estimate", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "run: error: spec.yaml sets task.fit_check, which task=estimate does not take: "
        "remove that line from spec.yaml, or keep the task option it was written for"
    )
    assert not (workdir / "outputs").exists()
