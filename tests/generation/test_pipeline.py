"""Pipeline-parallel generation: the stage split, and two gloo stages generating the same tokens as the whole model
in one process (transformers' generate for greedy decoding, a plain full-model loop for sampling)."""

import dataclasses

import pytest
import torch

from runner.components.modeling import build_model, build_tokenizer
from runner.errors import SpecError
from runner.generation.decoding import Decoding, next_tokens, prompt_batches
from runner.generation.pipelined import pipeline_generate
from runner.parallel.pipeline.layout import stage_bounds
from tests.support.specs import composed
from tests.support.workers import run_in_workers

PROMPTS = ["Hello", "The quick brown fox", "a", "pipeline parallel", "12345 678"]
MAX_NEW_TOKENS = 12
SEED = 7


def test_stage_bounds_split_evenly_with_the_earlier_stages_taking_the_rest():
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stage_bounds(4, 1) == [(0, 4)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_stage_bounds_follow_split_points():
    assert stage_bounds(4, 2, [1]) == [(0, 1), (1, 4)]
    assert stage_bounds(8, 3, [2, 7]) == [(0, 2), (2, 7), (7, 8)]


@pytest.mark.parametrize(
    "layers, stages, points, message",
    [
        (4, 2, [2, 3], "2 stages need 1"),
        (4, 3, [3, 2], "must be increasing"),
        (4, 3, [2, 2], "must be increasing"),
        (4, 2, [0], "between 1 and 3"),
        (4, 2, [4], "between 1 and 3"),
        (2, 3, None, "need at least 3 decoder layers"),
        (4, 0, None, "at least 1"),
    ],
)
def test_bad_split_points_are_refused_in_one_line(layers, stages, points, message):
    with pytest.raises(SpecError, match=message) as refused:
        stage_bounds(layers, stages, points)
    assert "\n" not in str(refused.value)


def tiny_model(model_config):
    torch.manual_seed(SEED)
    return build_model(model_config, build_tokenizer(model_config)).eval()


def batches_of(model_config, batch_size: int) -> list:
    tokenizer = build_tokenizer(model_config)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
    return prompt_batches(prompts, batch_size, tokenizer.pad_token_id)


def rows_until_eos(new_tokens: torch.Tensor, eos_token_id) -> list[list[int]]:
    rows = []
    for row in new_tokens.tolist():
        rows.append(row[: row.index(eos_token_id) + 1] if eos_token_id in row else row)
    return rows


def generated(model, batches: list, decoding: Decoding) -> list[list[int]]:
    """transformers' greedy generate on the whole model, batch by batch."""
    rows = []
    with torch.no_grad():
        for batch in batches:
            output = model.generate(
                batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=decoding.max_new_tokens,
                do_sample=False,
                pad_token_id=decoding.pad_token_id,
                eos_token_id=decoding.eos_token_id,
            )
            rows.extend(rows_until_eos(output[:, batch["input_ids"].shape[1] :], decoding.eos_token_id))
    return rows


def sampled(model, batches: list, decoding: Decoding, seed: int) -> list[list[int]]:
    """Sampling on the whole model, recomputing each sequence at every step, with the pipeline's generators."""
    rows = []
    with torch.no_grad():
        for index, batch in enumerate(batches):
            generator = torch.Generator().manual_seed(seed + index)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            for _ in range(decoding.max_new_tokens):
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = model(ids, attention_mask=mask, position_ids=position_ids).logits[:, -1]
                ids = torch.cat([ids, next_tokens(logits, ids, decoding, generator)[:, None]], dim=1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            rows.extend(ids[:, batch["input_ids"].shape[1] :].tolist())
    return rows


def _pipeline_runs(ranks, model_config, runs):
    """Each run's generated rows, each run on a freshly built model (pipeline_generate consumes it)."""
    return [
        pipeline_generate(
            tiny_model(model_config),
            batches_of(model_config, batch_size),
            decoding,
            ranks,
            stage_bounds(4, ranks.world_size),
            microbatches=2,
            seed=SEED,
            device=torch.device("cpu"),
        )
        for batch_size, decoding in runs
    ]


@pytest.fixture(scope="module")
def generations():
    """(expected, per-rank results) of each run: greedy without and with an eos that some rows reach, sampling."""
    # tiny_llama with larger initial weights: greedy decoding from the default init repeats one token forever.
    tiny_llama = composed([]).model
    model_config = dataclasses.replace(tiny_llama, architecture={**tiny_llama.architecture, "initializer_range": 0.2})
    pad = build_tokenizer(model_config).pad_token_id
    model = tiny_model(model_config)
    greedy = Decoding(max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad)
    first_rows = generated(model, batches_of(model_config, 3), greedy)
    # A token the first row produces early: it then stops there, the others where they meet it or at the limit.
    with_eos = Decoding(max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad, eos_token_id=first_rows[0][3])
    sampling = Decoding(max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad, do_sample=True, temperature=0.8, top_k=20)
    runs = [(3, greedy), (2, with_eos), (2, sampling)]
    expected = [
        first_rows,
        generated(model, batches_of(model_config, 2), with_eos),
        sampled(model, batches_of(model_config, 2), sampling, SEED),
    ]
    per_rank = run_in_workers(_pipeline_runs, model_config, runs, nproc=2)
    return expected, per_rank


@pytest.mark.slow
@pytest.mark.distributed
def test_two_stages_generate_greedily_what_generate_does(generations):
    expected, per_rank = generations
    for rank_runs in per_rank:
        assert rank_runs[0] == expected[0]
    assert all(len(row) == MAX_NEW_TOKENS for row in expected[0])
    assert all(len(set(row)) > 3 for row in expected[0]), "a row that repeats one token would prove little"


@pytest.mark.slow
@pytest.mark.distributed
def test_rows_stop_after_their_eos(generations):
    expected, per_rank = generations
    for rank_runs in per_rank:
        assert rank_runs[1] == expected[1]
    assert len(expected[1][0]) == 4
    assert len(expected[1]) == len(PROMPTS)


@pytest.mark.slow
@pytest.mark.distributed
def test_sampling_draws_from_each_batch_seeded_generator(generations):
    expected, per_rank = generations
    for rank_runs in per_rank:
        assert rank_runs[2] == expected[2]
    assert expected[2] != [row[:MAX_NEW_TOKENS] for row in expected[0]]
