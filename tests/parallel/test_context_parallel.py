"""Context parallelism (strategy.cp_size): each rank of a group runs a slice of every sequence of the same rows.

torch's ring attention runs on CUDA's kernels only, so on the CPU these tests check what surrounds it: the mesh,
the slices each rank gets (positions, targets shifted before the split, no attention mask), the group's sum of
its slices' losses and its gradient, the estimate, and the refusals. bench/context_parallel.py compares the
losses with one process's on a machine with two GPUs or more.
"""

import copy
import re

import pytest
import torch

from runner.parallel.dims import ParallelDims
from tests.support.specs import resolved_spec
from tests.support.workers import run_in_workers


def _slices(ranks, dims):
    from runner.data.batches import MicroBatch
    from runner.data.rows import IGNORE
    from runner.parallel.context import RingSplit

    ids = torch.arange(8).view(1, 8)
    labels = ids.clone()
    labels[0, :2] = IGNORE  # a prompt of two tokens
    batch = MicroBatch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels, tokens=8, label_tokens=5)
    with RingSplit(dims.mesh("cpu")["cp"]).split(batch) as (sliced, whole_loss):
        local = torch.tensor(float(ranks.rank + 1), requires_grad=True)
        total = whole_loss(local)
        total.backward()
    return {
        "inputs": sorted(sliced.inputs),
        "ids": sliced.inputs["input_ids"].tolist(),
        "positions": sliced.inputs["position_ids"].tolist(),
        "targets": sliced.labels.tolist(),
        "shifted": sliced.labels_shifted,
        "total": total.item(),
        "gradient": local.grad.item(),
        "whole_batch_untouched": ids.tolist() == [list(range(8))],
    }


@pytest.mark.distributed
def test_each_rank_gets_a_slice_from_each_end_with_its_positions_and_shifted_targets():
    """Sequence 0..7 over cp 2: rank 0 runs positions 0, 1, 6, 7 and rank 1 positions 2..5 (the causal work
    balanced); the targets are the next tokens, shifted before the split (a slice's last position predicts the next
    slice's first token); no attention mask goes in. The group's loss is the sum of its slices', on each rank, and
    each slice's gradient is that of the sum (every rank's backward adds one)."""
    from runner.data.rows import IGNORE

    places = run_in_workers(_slices, ParallelDims(cp=2), nproc=2)
    assert [place["positions"] for place in places] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert [place["ids"] for place in places] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert [place["targets"] for place in places] == [[[IGNORE, 2, 7, IGNORE]], [[3, 4, 5, 6]]]
    assert all(place["inputs"] == ["input_ids", "position_ids"] and place["shifted"] for place in places)
    assert [place["total"] for place in places] == [3.0, 3.0]
    assert [place["gradient"] for place in places] == [2.0, 2.0]
    assert all(place["whole_batch_untouched"] for place in places)


def test_the_attention_the_ring_takes_is_the_models_own_on_whole_rows():
    """Under context parallelism the model attends with causal sdpa, no mask, its key-value heads repeated (the call
    torch's ring takes). On whole rows, in one process, it gives transformers' own sdpa's logits and gradients,
    grouped heads included; and on a slice's positions (0, 1, 6, 7) it builds no mask, where transformers' own
    would read two packed sequences."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import create_causal_mask

    from runner.engine.attention import attend_with
    from runner.parallel.context import RingSplit, causal_unmasked_attention

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    own = LlamaForCausalLM(config)
    ring = LlamaForCausalLM(copy.deepcopy(config))
    ring.load_state_dict(own.state_dict())
    attend_with(ring, RingSplit.name, causal_unmasked_attention)
    assert (own.config._attn_implementation, ring.config._attn_implementation) == ("sdpa", "runner_causal_unmasked")
    ids = torch.randint(0, 64, (2, 16))
    outputs = [model(input_ids=ids, labels=ids) for model in (own, ring)]
    for output in outputs:
        output.loss.backward()
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits)
    for (name, mine), (_, theirs) in zip(ring.named_parameters(), own.named_parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, msg=name)
    positions = torch.tensor([[0, 1, 6, 7]])
    assert create_causal_mask(ring.config, torch.zeros(1, 4, 32), None, None, position_ids=positions) is None
    assert create_causal_mask(own.config, torch.zeros(1, 4, 32), None, None, position_ids=positions) is not None


def _context_places(ranks, dims):
    mesh = dims.mesh("cpu")
    return {
        "batch": mesh.get_local_rank("dp_shard"),
        "cp": mesh.get_local_rank("cp"),
        "dp_rank": dims.dp_rank(ranks.rank),
        "counted": dims.counted(ranks.rank),
        "sharded_over": dims.sharding_mesh("cpu").size(),
    }


@pytest.mark.distributed
def test_context_parallel_ranks_run_the_same_rows_and_fsdp_shards_over_them():
    """On a dp_shard 2 x cp 2 mesh of 4 processes: the ranks of a context-parallel group read the same part of the
    batch, one of them counts in sums (the group sums its slices' losses first), and FSDP shards over all four."""

    places = run_in_workers(_context_places, ParallelDims(dp_shard=2, cp=2), nproc=4)
    assert [place["batch"] for place in places] == [place["dp_rank"] for place in places] == [0, 0, 1, 1]
    assert [place["cp"] for place in places] == [0, 1, 0, 1]
    assert [place["counted"] for place in places] == [True, False, True, False]
    assert {place["sharded_over"] for place in places} == {4}


def test_context_parallelism_is_estimated_by_its_slices_and_refused_where_it_cannot_run():
    """Llama-3-70B on 8 H100s at 64k tokens: cp 2 holds half a sequence's activations, with FSDP's shards over all
    eight ranks; what torch's ring does not run yet is refused before launch."""
    from runner.errors import SpecError
    from runner.memory.breakdown import estimate
    from runner.memory.model_shapes import facts_of

    overrides = [
        "task=estimate",
        "model=llama3_70b",
        "strategy=fsdp",
        "precision=bf16",
        "hardware=8xh100_80gb",
        "data.seq_len=65536",
        "train.micro_batch_size=1",
        "strategy.activation_checkpointing=true",
    ]
    whole, sliced = resolved_spec(overrides), resolved_spec([*overrides, "strategy.cp_size=2"])
    facts = facts_of(whole.model)
    alone, split = estimate(whole, facts), estimate(sliced, facts)
    assert split.activations.bytes == pytest.approx(alone.activations.bytes / 2, rel=1e-3)
    assert split.optimizer_states.bytes == pytest.approx(alone.optimizer_states.bytes, rel=1e-3)
    assert "a 1/2 slice of each sequence (context parallel)" in split.activations.note
    for extra, refusal in (
        (["data.packing=true"], "data.packing=true"),
        (["strategy.tp_size=2"], "strategy.tp_size=2: not composed yet"),
        (["strategy.pp_size=2", "train.grad_accum_steps=2"], "strategy.pp_size=2: not composed"),
    ):
        with pytest.raises(SpecError, match=re.escape("strategy.cp_size=2 with ") + ".*" + re.escape(refusal)):
            resolved_spec([*overrides, "strategy.cp_size=2", *extra])
