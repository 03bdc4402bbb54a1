"""The inference estimate (runner/memory/inference_estimate.py, inference_report.py): the KV cache and weights of
Llama-3-8B, the layouts (replica, pipeline, sharded, a device_map placement), the report and the fit check, and the
activations against the tensors a real CPU forward of tiny_llama holds. Fast: no process is started."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from runner.config.task import DeviceMap
from runner.errors import SpecError
from runner.memory.breakdown import gib
from runner.memory.inference_estimate import (
    InferenceLoad,
    activations_part,
    inference_estimate,
    kv_cache_bytes,
    logits_bytes,
    model_parts,
    pipeline_load,
    stage_layers,
)
from runner.memory.inference_report import Options, check_inference_fit, inference_answer, inference_report
from runner.memory.model_shapes import facts_of
from tests.support.specs import composed

GIB = 1024**3
RTX4090 = ["hardware=2xrtx4090"]


@pytest.fixture(scope="module")
def llama8b():
    spec = composed(["model=llama3_8b", *RTX4090])
    return spec, facts_of(spec.model)


def bf16_generate(batch: int, tokens: int, **keys) -> InferenceLoad:
    return InferenceLoad(batch, tokens, kv_cache=True, weight_bytes_per_param=2, activation_bytes=2, **keys)


# ---- the terms on Llama-3-8B's shape (32 layers, 8 kv heads, head dim 128)


def test_kv_cache_of_llama3_8b_is_one_gib_per_8192_tokens_in_bf16(llama8b):
    _, facts = llama8b
    assert (facts.layers, facts.layer.kv_heads, facts.layer.head_dim) == (32, 8, 128)
    assert kv_cache_bytes(facts, bf16_generate(1, 8192)) == 8192 * 32 * 2 * 8 * 128 * 2 == GIB
    assert inference_estimate(facts, bf16_generate(8, 4096)).kv_cache.bytes == 4 * GIB
    fp32_cache = InferenceLoad(1, 8192, kv_cache=True, weight_bytes_per_param=4, activation_bytes=4)
    assert kv_cache_bytes(facts, fp32_cache) == 2 * GIB
    evaluate = InferenceLoad(8, 4096, kv_cache=False, weight_bytes_per_param=2, activation_bytes=2)
    assert inference_estimate(facts, evaluate).kv_cache.bytes == 0


def test_weights_of_llama3_8b_in_bf16_are_about_15_gib(llama8b):
    _, facts = llama8b
    weights = inference_estimate(facts, bf16_generate(1, 128)).weights.bytes
    assert weights == facts.parameters * 2 + facts.buffer_bytes
    assert gib(weights) == "14.96"


def test_model_parts_add_up_to_the_parameters(llama8b):
    _, facts = llama8b
    parts = model_parts(facts)
    assert parts.embedding == 128_256 * 4096 and parts.block == 218_112_000
    assert parts.embedding + facts.layers * parts.block + parts.head == facts.parameters  # untied: no LM head twice
    assert parts.rest == facts.parameters - facts.layers * parts.block
    assert stage_layers(32, 2) == [16, 16] and stage_layers(10, 4) == [3, 3, 2, 2]


def test_pipeline_of_two_stages_halves_the_layers_share(llama8b):
    _, facts = llama8b
    load = bf16_generate(8, 4096)
    parts = model_parts(facts)
    whole = inference_estimate(facts, load)
    stage = inference_estimate(facts, load, devices=2, how="pipeline")
    assert stage.where == "stage 2 of 2, the largest"  # the LM head's stage: it holds the logits too
    layers_share = facts.layers * parts.block * 2
    assert stage.weights.bytes - parts.head * 2 - facts.buffer_bytes == layers_share // 2
    assert stage.kv_cache.bytes == whole.kv_cache.bytes // 2 == 2 * GIB
    assert stage.peak < whole.peak
    # One stage is the whole model.
    assert inference_estimate(facts, load, devices=1, how="pipeline").peak == whole.peak
    with pytest.raises(SpecError, match="at least as many layers"):
        inference_estimate(facts, load, devices=33, how="pipeline")


def test_sharded_holds_a_shard_and_the_gathered_root_and_two_blocks(llama8b):
    _, facts = llama8b
    load = bf16_generate(1, 1024)
    parts = model_parts(facts)
    sharded = inference_estimate(facts, load, devices=2, how="sharded")
    assert sharded.weights.bytes == (facts.parameters // 2 + parts.rest + 2 * parts.block) * 2 + facts.buffer_bytes
    assert sharded.kv_cache.bytes == inference_estimate(facts, load).kv_cache.bytes  # each device its own rows


def test_evaluate_holds_every_position_s_logits_and_log_softmax_generate_the_last(llama8b):
    _, facts = llama8b
    evaluate = InferenceLoad(2, 1024, kv_cache=False, weight_bytes_per_param=2, activation_bytes=2)
    logits = 2 * 1024 * facts.vocab * (2 + 4 + 4)  # bf16 logits, their fp32 copy, the fp32 log-softmax
    assert activations_part(facts, evaluate).bytes == 2 * 1024 * 2 * 2 * 4096 + logits  # + final norm in and out
    assert logits_bytes(facts, bf16_generate(2, 1024)) == 2 * 1024 * facts.vocab * 2  # the prefill's, no loss
    assert logits_bytes(facts, bf16_generate(2, 1024, logits_to_keep=1)) == 2 * facts.vocab * 2  # generate()'s
    last = activations_part(facts, bf16_generate(2, 1024, logits_to_keep=1)).bytes
    assert activations_part(facts, bf16_generate(2, 1024)).bytes > last
    assert activations_part(facts, bf16_generate(2, 1024, prompt_tokens=128, logits_to_keep=1)).bytes < last
    assert pipeline_load(bf16_generate(2, 1024)).kv_cache is False  # the runner's pipeline recomputes every step


def test_fp32_weights_under_autocast_add_the_casts_autocast_keeps(llama8b):
    _, facts = llama8b
    fp32 = InferenceLoad(1, 128, kv_cache=True, weight_bytes_per_param=4, activation_bytes=2, logits_to_keep=1)
    kept = activations_part(facts, fp32).bytes
    frozen = activations_part(facts, replace(fp32, frozen=True)).bytes
    assert kept - frozen == 2 * (facts.linear_parameters - facts.largest_parameter)


# ---- the report and the fit check


def test_report_of_llama3_8b_generating_on_a_24_gib_device(llama8b):
    spec, facts = llama8b
    text = inference_report(spec, facts, bf16_generate(8, 4096), devices=1)
    lines = text.splitlines()
    assert lines[0].startswith("inference memory estimate: LlamaForCausalLM (8,030,261,248 parameters), generate")
    assert "NVIDIA GeForce RTX 4090, 23.6 GiB" in lines[1]
    assert [line.split()[0] for line in lines[2:6]] == ["weights", "KV", "activations", "total"]
    assert "14.96 GiB" in lines[2] and "4.00 GiB" in lines[3]
    assert lines[6].startswith("  fits: NO")
    assert "task.batch_size=4" in lines[7] and "task.device_map=auto" in lines[7]
    assert "fits: yes" in inference_report(spec, facts, bf16_generate(1, 4096, logits_to_keep=1), devices=1)


def test_weights_beyond_the_device_fail_the_fit_check_in_one_line_naming_device_map(llama8b):
    spec, facts = llama8b
    fp32_weights = InferenceLoad(1, 512, kv_cache=True, weight_bytes_per_param=4, activation_bytes=4)
    with pytest.raises(SpecError) as error:
        check_inference_fit(spec, facts, fp32_weights, devices=1)
    message = str(error.value)
    assert "\n" not in message
    assert "23.6 GiB" in message and "device_map=auto" in message and "task.pipeline_stages=2" in message
    evaluate = Options(batch="train.micro_batch_size", pipeline=None)  # evaluate has no pipeline
    with pytest.raises(SpecError, match="device_map=auto") as error:
        check_inference_fit(spec, facts, replace(fp32_weights, kv_cache=False), devices=1, options=evaluate)
    assert "pipeline" not in str(error.value)
    check_inference_fit(spec, facts, bf16_generate(1, 512), devices=1)  # 15 GiB of bf16 weights fit


def test_an_unknown_device_memory_passes_and_says_so(llama8b):
    spec, facts = llama8b
    unknown = replace(spec, hardware=replace(spec.hardware, device_memory_gib=None))
    check_inference_fit(unknown, facts, bf16_generate(64, 8192))
    assert "fits: unknown" in inference_report(unknown, facts, bf16_generate(64, 8192))


def test_a_placement_shows_cpu_ram_and_disk_as_rows_and_counts_the_device_s_share(llama8b):
    spec, facts = llama8b
    load = bf16_generate(1, 1024, logits_to_keep=1)
    placement = {0: 10 * GIB, "cpu": 4 * GIB, "disk": 1 * GIB}
    placed = inference_estimate(facts, load, placement=placement)
    assert placed.weights.bytes == 10 * GIB + model_parts(facts).block * 2  # + an offloaded block brought in
    assert placed.off_device == {"CPU RAM": 4 * GIB, "disk": 1 * GIB}
    text = inference_report(spec, facts, load, placement=placement)
    assert "in CPU RAM" in text and "in disk" in text and "fits: yes" in text
    # A GPU filled to its limit leaves no room for the cache: the check proposes a lower limit.
    full = {0: 23 * GIB, "cpu": 7 * GIB}
    with pytest.raises(SpecError, match=r"task.max_memory.0=\d"):
        check_inference_fit(spec, facts, load, placement=full)


def test_inference_answer_reports_or_checks_as_the_task_asks(llama8b):
    spec, _ = llama8b
    task = SimpleNamespace(device_map=DeviceMap.none, max_memory={}, estimate_only=True, fit_check=True)
    fp32 = replace(spec, hardware=replace(spec.hardware, nproc_per_node=1))  # the spec's default: fp32 weights
    report = inference_answer(fp32, task, batch_size=1, tokens=512, kv_cache=True)
    assert "fp32 weights" in report and "fits: NO" in report
    with pytest.raises(SpecError, match="does not fit"):
        inference_answer(fp32, replace_task(task, estimate_only=False), batch_size=1, tokens=512, kv_cache=True)
    assert (
        inference_answer(
            fp32, replace_task(task, estimate_only=False, fit_check=False), batch_size=1, tokens=512, kv_cache=True
        )
        is None
    )
    pipeline = inference_answer(spec, task, batch_size=1, tokens=512, kv_cache=True, stages=2)
    assert "a pipeline of 2 stages" in pipeline and "none (each step runs the whole rows)" in pipeline


def replace_task(task: SimpleNamespace, **keys) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(task), **keys})


# ---- against a real forward on the CPU


def test_activations_bound_what_a_tiny_llama_forward_holds_on_the_cpu():
    """The tensors a no_grad forward of tiny_llama creates and holds at once, counted by storage; the estimate is
    at or above them, by less than a half."""
    import torch

    from runner.components.modeling import build_model, build_tokenizer

    spec = composed(["model=tiny_llama"])
    facts = facts_of(spec.model)
    rows, tokens = 4, 256
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = build_model(spec.model, build_tokenizer(spec.model)).to(dtype).eval()
        ids = torch.randint(3, 200, (rows, tokens))
        mask = torch.ones(rows, tokens, dtype=torch.long)
        mask[0, :10] = 0  # a left-padded row: the 4-d mask is built
        with torch.no_grad(), LiveBytes(model) as evaluate:
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            del logits
        with torch.no_grad(), LiveBytes(model) as prefill:
            del model(ids, attention_mask=mask, use_cache=True).logits
        evaluate_load = InferenceLoad(rows, tokens, kv_cache=False, weight_bytes_per_param=size, activation_bytes=size)
        prefill_load = replace(evaluate_load, kv_cache=True)
        estimated_evaluate = activations_part(facts, evaluate_load).bytes
        estimated_prefill = activations_part(facts, prefill_load).bytes + kv_cache_bytes(facts, prefill_load)
        assert evaluate.peak <= estimated_evaluate < 1.5 * evaluate.peak, (dtype, evaluate.peak, estimated_evaluate)
        assert prefill.peak <= estimated_prefill < 1.5 * prefill.peak, (dtype, prefill.peak, estimated_prefill)


class LiveBytes:
    """The most bytes the storages created under it (not the model's own) hold at once."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.record(out)
                return out

        self.mode = Mode()
        self.held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.live: dict[int, tuple] = {}
        self.peak = 0

    def record(self, out) -> None:
        import torch
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.held:
                storage = tensor.untyped_storage()
                self.live.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.live = {key: value for key, value in self.live.items() if not value[0].expired()}
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
