"""A MoE model's router terms (runner/engine/router.py): the load-balancing loss is transformers' own, the forward
records it beside its summed loss, and the log's load figures read the experts' token counts."""

import numpy as np
import pytest
import torch

from runner.components.modeling import build_model, byte_tokenizer
from runner.config.training import LossKind
from runner.data.batches import shifted
from runner.data.rows import IGNORE
from runner.engine.job import prepare_job
from runner.engine.loop import train
from runner.engine.loss import with_summed_loss
from runner.engine.router import EXPERT_TOKENS, load_figures, router_loss, router_of, router_terms
from tests.support.runs import logged
from tests.support.specs import QUICK_STEPS, composed, resolved_spec

MOE_MODELS = ["tiny_qwen3_moe", "tiny_mixtral", "tiny_gpt_oss"]


def _model_and_batch(option: str, *overrides: str):
    torch.manual_seed(0)
    spec = composed([f"model={option}", *overrides])
    model = build_model(spec.model, byte_tokenizer())
    input_ids = torch.randint(3, 200, (2, 24))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 17:] = 0  # the second row padded: its padding counts in no term
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return spec, model, input_ids, attention_mask, labels


@pytest.mark.parametrize("option", MOE_MODELS)
def test_the_aux_loss_is_transformers_own_and_so_is_the_loss_it_makes(option):
    spec, model, input_ids, attention_mask, labels = _model_and_batch(option)
    own = model(input_ids, attention_mask=attention_mask, labels=labels, output_router_logits=True)
    router = router_loss(model.config, spec.model)
    terms = router_terms(own.router_logits, attention_mask, router.experts, router.top_k)
    assert terms.aux.item() == pytest.approx(own.aux_loss.item(), rel=1e-5)

    # the same through the runner's forward: its summed loss, and the terms it records for the step
    with_summed_loss(model, LossKind.full, 1024, router)
    summed = model(input_ids, attention_mask=attention_mask, loss_labels=labels)
    added, metrics = router_of(model).taken(weight=1.0)
    label_tokens = (shifted(labels) != IGNORE).sum()
    assert (summed / label_tokens + added).item() == pytest.approx(own.loss.item(), rel=1e-5)
    assert added.item() == pytest.approx(router.aux_coef * own.aux_loss.item(), rel=1e-5)
    # each real token went to top_k experts in each MoE layer
    assert metrics[EXPERT_TOKENS].sum(1).tolist() == [attention_mask.sum().item() * router.top_k] * 2


def test_the_chunked_loss_records_the_same_terms_and_no_grad_forwards_none():
    spec, model, input_ids, attention_mask, labels = _model_and_batch(
        "tiny_qwen3_moe", "model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001"
    )
    own = model(input_ids, attention_mask=attention_mask, output_router_logits=True)
    router = router_loss(model.config, spec.model)
    assert (router.aux_coef, router.z_coef) == (0.01, 0.001)
    with_summed_loss(model, LossKind.chunked, 16, router)
    with torch.no_grad():  # a reference's or an evaluation's forward
        model(input_ids, attention_mask=attention_mask, loss_labels=labels)
    assert router.recorded == []
    model(input_ids, attention_mask=attention_mask, loss_labels=labels)
    added, metrics = router.taken(weight=0.25)
    real = attention_mask.flatten().bool()
    z = torch.stack([layer[real].logsumexp(-1).square().mean() for layer in own.router_logits]).mean()
    assert metrics["router/z_loss"].item() == pytest.approx(0.25 * z.item(), rel=1e-5)
    assert metrics["router/aux_loss"].item() == pytest.approx(0.25 * own.aux_loss.item(), rel=1e-5)
    assert added.item() == pytest.approx(0.25 * (0.01 * own.aux_loss.item() + 0.001 * z.item()), rel=1e-5)
    added.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_a_dense_model_has_no_router_terms():
    spec, model, *_ = _model_and_batch("tiny_llama")
    assert router_loss(model.config, spec.model) is None


def test_the_load_figures_show_each_layers_imbalance_and_the_dead_experts():
    tokens = np.array([[4.0, 4.0, 4.0, 4.0], [10.0, 6.0, 0.0, 0.0]])
    figures = load_figures({"router/aux_loss": 2.0, EXPERT_TOKENS: tokens})
    assert figures == {
        "router/aux_loss": 2.0,
        "router/load_max_over_mean": 2.5,
        "router/load_max_over_mean/layer0": 1.0,
        "router/load_max_over_mean/layer1": 2.5,
        "router/dead_experts": 0.25,
    }


def _final_load(tmp_path, aux_coef: str) -> float:
    run_dir = tmp_path / aux_coef
    run_dir.mkdir()
    spec = resolved_spec(
        [
            *QUICK_STEPS,
            "model=tiny_qwen3_moe",
            "data.seq_len=64",
            "train.max_steps=20",
            "train.log_every=10",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.save_model=false",
            f"model.router_aux_loss_coef={aux_coef}",
        ]
    )
    train(prepare_job(spec, run_dir))
    return logged(run_dir, "router/load_max_over_mean")[20]  # the last 10 steps' tokens per expert


@pytest.mark.slow
def test_the_aux_loss_keeps_the_experts_from_collapsing(tmp_path):
    # From a random init, the tiny Qwen3-MoE sends most tokens to one expert of eight (max over mean near 4, the
    # most top-2 routing allows) and without the loss stays there; with it, the last 10 steps' load is near 2.4.
    balanced, free = _final_load(tmp_path, "0.1"), _final_load(tmp_path, "0")
    assert balanced < free - 0.5, f"max/mean load with the aux loss {balanced:.3f}, without {free:.3f}"
