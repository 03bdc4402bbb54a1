"""Chat data (runner/data/chat.py): conversations in the layouts users have, rendered with the model's chat
template, trained on the tokens TRL's assistant_only_loss trains (TRL as the oracle), named in one line when bad."""

import json
import re
from pathlib import Path

import pytest

from runner.components.modeling import byte_tokenizer
from runner.config.data import DataConfig, DataFormat
from runner.data.chat import ChatRenderer, Conversation, conversation
from runner.data.rows import IGNORE
from runner.data.splits import token_splits
from runner.errors import SpecError
from tests.support import DATA
from tests.support.command import run_cli
from tests.support.runs import run_dirs
from tests.support.specs import TWO_BLOCKS

TEMPLATES = DATA / "trl_chat_templates"
LLAMA_FACTORY = DATA / "llama_factory"

SYSTEM_AND_TURNS = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two, the only even prime."},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WITH_TOOLS = [
    {"role": "system", "content": "You use tools when they help."},
    {"role": "user", "content": "Is it raining in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
    },
    {"role": "tool", "content": '{"rain": true}'},
    {"role": "assistant", "content": "Yes, it is raining in Oslo."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


def chat_tokenizer(*templates: str):
    """The byte tokenizer with the templates' special tokens (<|eot_id|>, <|im_start|>, ...) as tokens of their own,
    as the models' tokenizers have them."""
    tokenizer = byte_tokenizer()
    markers = set()
    for template in templates:
        markers |= set(re.findall(r"<\|[^<>|\s]{1,40}\|>|<(?:start|end)_of_turn>|\[/?gMASK\]|<sop>", template))
    tokenizer.add_special_tokens({"additional_special_tokens": sorted(markers)})
    return tokenizer


def trl_training_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}_training.jinja").read_text()


def trl_mask(tokenizer, template: str, messages, tools) -> tuple[list[int], list[int]]:
    """What TRL's SFTTrainer trains with assistant_only_loss: the template's {% generation %} spans, as
    transformers' apply_chat_template(return_assistant_tokens_mask=True) gives them."""
    found = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(found["input_ids"]), list(found["assistant_masks"])


# TRL's training variant of these templates also trains the tokens listed, which the template's generation
# prompt holds: the model never writes them (it is given them), so the runner does not train them.
TRL_ALSO_TRAINS = {"qwen2_5": {"\n"}}
WITH_TOOL_TURNS = {"llama3", "qwen2_5", "qwen3", "glm4moe"}


@pytest.mark.parametrize(
    "name", ["llama3", "qwen2_5", "qwen3", "gemma3", "phi3", "glm4moe", "cohere2", "lfm2", "qwen3_instruct_2507"]
)
def test_the_trained_tokens_are_those_trl_trains_with_assistant_only_loss(name):
    training = trl_training_template(name)
    tokenizer = chat_tokenizer((TEMPLATES / f"{name}.jinja").read_text(), training)
    cases = [(SYSTEM_AND_TURNS, None)] + ([(WITH_TOOLS, [WEATHER_TOOL])] if name in WITH_TOOL_TURNS else [])
    for messages, tools in cases:
        ids, expected = trl_mask(tokenizer, training, messages, tools)
        found, mask = ChatRenderer(tokenizer, training, "assistant")(Conversation(messages, tools), "test", "it")
        assert found == ids
        assert sum(mask) > 10
        differ = {tokenizer.decode([ids[i]]) for i in range(len(ids)) if mask[i] != expected[i]}
        assert differ == TRL_ALSO_TRAINS.get(name, set()), name
        assert all(expected[i] for i in range(len(ids)) if mask[i])  # never more than TRL


@pytest.mark.parametrize(
    "name", ["llama3", "llama3_2", "qwen2_5", "gemma3", "phi3", "cohere2", "lfm2", "qwen3_instruct_2507"]
)
def test_a_models_own_template_trains_what_its_training_variant_does(name):
    """The templates as the models ship them, without generation markers: the mask comes from the rendering."""
    plain = (TEMPLATES / f"{name}.jinja").read_text()
    training_name = {"llama3_2": "llama3"}.get(name, name)
    training = trl_training_template(training_name)
    tokenizer = chat_tokenizer(plain, training)
    plain_renderer, training_renderer = (
        ChatRenderer(tokenizer, template, "assistant") for template in (plain, training)
    )
    conversation_ = Conversation(SYSTEM_AND_TURNS)
    if name == "llama3_2":  # its own header (knowledge cutoff, today's date) renders other text than Llama 3's
        ids, mask = plain_renderer(conversation_, "test", "it")
        assert (
            tokenizer.decode([t for t, m in zip(ids, mask) if m])
            == "Seven.<|eot_id|>Two, the only even prime.<|eot_id|>"
        )
        return
    assert plain_renderer(conversation_, "test", "it") == training_renderer(conversation_, "test", "it")


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line():
    """Qwen3's own template renders an assistant turn with an empty reasoning block when it is the last, without
    one when a user turn follows: a turn's tokens cannot be told from the rendering. TRL's training variant keeps
    earlier turns as they were, and is accepted."""
    plain = (TEMPLATES / "qwen3.jinja").read_text()
    renderer = ChatRenderer(chat_tokenizer(plain), plain, "assistant")
    with pytest.raises(
        SpecError,
        match=r"^data.files: pairs.jsonl line 3: the chat template renders an earlier turn "
        r"differently once later turns follow",
    ):
        renderer(Conversation(SYSTEM_AND_TURNS), "data.files", "pairs.jsonl line 3")


def test_a_template_whose_turns_end_on_no_token_of_their_own_is_refused():
    """GLM-4-MoE's own template leaves an assistant turn's end to the next message's header: trained on the turn
    alone, the model would never stop. TRL's training variant trains that header, and is accepted."""
    plain = (TEMPLATES / "glm4moe.jinja").read_text()
    with pytest.raises(SpecError, match=r"^the chat template ends an assistant turn on no token of its own"):
        ChatRenderer(chat_tokenizer(plain), plain, "assistant")
    ChatRenderer(chat_tokenizer(plain), trl_training_template("glm4moe"), "assistant")


@pytest.mark.parametrize(
    "name,end", [("llama3", "<|eot_id|>"), ("qwen2_5", "<|im_end|>"), ("gemma3", "<end_of_turn>"), ("phi3", "<|end|>")]
)
def test_generation_asks_as_the_template_does_and_stops_at_the_end_of_the_turn(name, end):
    """task=generate on chat data: a prompt becomes the user turn and the template's generation prompt, and the
    completion ends at the token that ends an assistant turn."""
    template = (TEMPLATES / f"{name}.jinja").read_text()
    tokenizer = chat_tokenizer(template)
    renderer = ChatRenderer(tokenizer, template, "assistant")
    asked = renderer.prompt("Name a prime number.", "prompt 0")
    assert asked == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a prime number."}],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert asked.rstrip().endswith(
        ("assistant<|end_header_id|>", "<|im_start|>assistant", "<start_of_turn>model", "<|assistant|>")
    )
    assert tokenizer.convert_ids_to_tokens(renderer.end_of_turn) == end


def test_train_on_the_last_assistant_turn_or_all():
    template = (TEMPLATES / "llama3.jinja").read_text()
    tokenizer = chat_tokenizer(template)
    trained = {}
    for train_on in ("assistant", "last_assistant", "all"):
        ids, mask = ChatRenderer(tokenizer, template, train_on)(Conversation(SYSTEM_AND_TURNS), "test", "it")
        trained[train_on] = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained["assistant"] == "Seven.<|eot_id|>Two, the only even prime.<|eot_id|>"
    assert trained["last_assistant"] == "Two, the only even prime.<|eot_id|>"
    assert trained["all"] == tokenizer.decode(ids)


def test_sharegpt_and_alpaca_records_become_the_same_conversation_as_messages():
    messages = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    alpaca = {"instruction": "Hi", "input": "", "output": "Hello"}
    found = [conversation(record, "auto", "data.files", "x") for record in (messages, sharegpt, alpaca)]
    assert found[0] == found[1] == found[2] == Conversation(messages["messages"])
    with_input = conversation(
        {"instruction": "Add", "input": "2 and 3", "output": "5", "system": "Be exact.", "history": [["Hi", "Hello"]]},
        "alpaca",
        "data.files",
        "x",
    )
    assert [(m["role"], m["content"]) for m in with_input.messages] == [
        ("system", "Be exact."),
        ("user", "Hi"),
        ("assistant", "Hello"),
        ("user", "Add\n2 and 3"),
        ("assistant", "5"),
    ]


def test_llama_factorys_tool_calls_become_the_templates_tool_turns():
    """LLaMA-Factory's glaive demo (tests/support/data/llama_factory/SOURCE.md): function_call and observation turns,
    and tools as a JSON string."""
    records = json.loads((LLAMA_FACTORY / "glaive_toolcall_en_demo.json").read_text())
    with_call = next(
        record for record in records if any(turn["from"] == "function_call" for turn in record["conversations"])
    )
    found = conversation(with_call, "auto", "data.files", "x")
    call = next(message for message in found.messages if message.get("tool_calls"))
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"]
    assert any(message["role"] == "tool" for message in found.messages)
    assert isinstance(found.tools, list) and found.tools[0]["name"]
    template = (TEMPLATES / "qwen2_5.jinja").read_text()
    tokenizer = chat_tokenizer(template)
    ids, mask = ChatRenderer(tokenizer, template, "assistant")(found, "data.files", "x")
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "<tool_call>" in trained and "<tool_response>" not in trained


@pytest.mark.parametrize(
    "record,message",
    [
        (
            {"messages": [{"role": "wizard", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            "message 0 has role 'wizard'; the roles are system, user, assistant, tool",
        ),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "has no assistant turn: nothing to train on"),
        (
            {"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "Hello"}]},
            "message 0 (user) is empty",
        ),
        ({"conversations": [{"from": "narrator", "value": "Once"}]}, "turn 0 is from 'narrator'"),
        ({"question": "Hi"}, "has none of the chat layouts' keys"),
    ],
)
def test_bad_conversations_are_named_in_one_line(record, message, tmp_path):
    with pytest.raises(SpecError, match=re.escape(message)):
        conversation(record, "auto", "data.files", "chats.jsonl line 1")


def test_a_chat_run_trains_the_assistant_turns_and_refuses_bad_input_in_one_line(tmp_path):
    """data=chat_files as a user runs it: LLaMA-Factory's Alpaca demo as chat, with a tokenizer that carries Llama
    3's template and special tokens (saved and read back as a model's tokenizer is); then a conversation Gemma 3's
    template refuses (user and assistant must alternate), and a tokenizer without a template; the byte tokenizer's
    own plain template trains each answer and its </s>."""
    from transformers import AutoTokenizer

    llama3, gemma3 = ((TEMPLATES / f"{name}.jinja").read_text() for name in ("llama3", "gemma3"))
    tokenizer = chat_tokenizer(llama3, gemma3)
    tokenizer.chat_template = llama3
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    chats = tmp_path / "chats.jsonl"
    records = json.loads((LLAMA_FACTORY / "alpaca_en_demo.json").read_text())[:200]
    chats.write_text("".join(json.dumps(record) + "\n" for record in records))
    result = run_cli(
        "data=chat_files",
        f"data.files={chats}",
        f"model.tokenizer={tmp_path / 'tokenizer'}",
        "data.seq_len=512",
        "data.packing=true",
        "train.max_steps=2",
        "train.eval_batches=1",
        "train.micro_batch_size=2",
        cwd=tmp_path / "run",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [run_dir] = run_dirs(tmp_path / "run")
    assert AutoTokenizer.from_pretrained(run_dir / "model").chat_template == llama3  # generation renders with it
    (tmp_path / "prompts.txt").write_text("Name a prime number.\n")
    generated = run_cli(
        "task=generate",
        f"task.trained={run_dir}",
        f"task.prompts={tmp_path / 'prompts.txt'}",
        "task.max_new_tokens=4",
        cwd=tmp_path / "generate",
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    [completion] = [
        json.loads(line) for line in (run_dirs(tmp_path / "generate")[0] / "completions.jsonl").read_text().splitlines()
    ]
    assert completion["prompt"] == "Name a prime number." and completion["new_tokens"] <= 4
    rows, _ = token_splits(
        DataConfig(files=str(chats), format=DataFormat.chat, seq_len=512, packing=True),
        AutoTokenizer.from_pretrained(tmp_path / "tokenizer"),
        seed=0,
    )
    assert 0.4 < rows.label_tokens.sum() / rows.tokens.sum() < 0.9  # the answers and their <|eot_id|>, not the rest
    row = rows[0]
    trained = [token for token, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
    assert tokenizer.decode(trained).count("<|eot_id|>") == row["position_ids"].count(0)  # one turn an example

    shown = run_cli(
        "--show-data",
        "2",
        "data=chat_files",
        f"data.files={chats}",
        f"model.tokenizer={tmp_path / 'tokenizer'}",
        "data.seq_len=512",
        "data.packing=true",
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = shown.stdout.split("--- train row ")[1:]
    assert len(rows) == 2 and rows[0].startswith("0\n<s><|start_header_id|>user<|end_header_id|>")
    answers = re.findall(r"\[\[(.*?)\]\]", rows[0], re.S)
    assert answers and all(answer.endswith("<|eot_id|>") for answer in answers)  # each answer and its end, no more
    assert "<|start_header_id|>" not in "".join(answers)
    assert re.search(
        r"\d+ train and \d+ eval rows of up to 512 tokens; [\d,]+ train tokens, [\d,]+ of them trained "
        r"\(\d+%\); \d+ of 200 examples longer than data.seq_len=512, cut$",
        shown.stdout.strip(),
    )

    alternating = tmp_path / "alternating.jsonl"
    alternating.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "user", "content": "Again"},
                    {"role": "assistant", "content": "Hello"},
                ]
            }
        )
        + "\n"
    )
    refused = run_cli(
        "data=chat_files",
        f"data.files={alternating}",
        f"model.tokenizer={tmp_path / 'tokenizer'}",
        f"data.chat_template={TEMPLATES / 'gemma3.jinja'}",
        cwd=tmp_path / "refused",
    )
    assert refused.returncode == 2
    assert refused.stderr == (
        f"run: error: data.files: {alternating} line 1: the chat template refuses it: "
        "Conversation roles must alternate user/assistant/user/assistant/...\n"
    )
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(
        "".join(
            json.dumps({"instruction": text, "output": "Fine."}) + "\n"
            for text in ("Short.", "A long question. " * 40, "Short again.")
        )
    )
    too_long = run_cli(
        "data=chat_files",
        f"data.files={long_prompt}",
        f"model.tokenizer={tmp_path / 'tokenizer'}",
        "data.train_on=last_assistant",
        "data.seq_len=256",
        cwd=tmp_path / "refused",
    )
    assert too_long.returncode == 2
    assert too_long.stderr == (
        f"run: error: data.files: {long_prompt} line 2: its last assistant turn starts past "
        "data.seq_len=256, so under data.train_on=last_assistant it trains nothing; raise "
        "data.seq_len, shorten the conversation or train on every assistant turn\n"
    )
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "no_template")
    no_template = run_cli(
        "data=chat_files",
        f"data.files={chats}",
        f"model.tokenizer={tmp_path / 'no_template'}",
        cwd=tmp_path / "refused",
    )
    assert no_template.returncode == 2
    assert no_template.stderr == (
        "run: error: data.format=chat needs a chat template, and the tokenizer has none; "
        "give one with data.chat_template=<a Jinja file>\n"
    )
    assert list((tmp_path / "refused").iterdir()) == []  # nothing written, not even outputs/


def test_streamed_conversations_train_what_stored_ones_do():
    """data.streaming=true reads the same records through datasets and masks them the same way."""
    import itertools

    from runner.data.stream import StreamedRows, StreamPosition

    template = TEMPLATES / "llama3.jinja"
    tokenizer = chat_tokenizer(template.read_text())
    data = DataConfig(
        files=str(DATA / "torchtune" / "alpaca_tiny.json"),
        format=DataFormat.chat,
        chat_template=str(template),
        seq_len=256,
        streaming=True,
    )
    rows = [row for row, _ in itertools.islice(StreamedRows(data, tokenizer, 0, 0, 1).rows(StreamPosition()), 20)]
    for row in rows:
        trained = [token for token, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
        assert trained and len(trained) < len(row["input_ids"])
        assert tokenizer.decode(trained).endswith("<|eot_id|>") or len(row["input_ids"]) == 256  # or cut


# --- training on real chat data, under every strategy ---

STEPS = 6
REAL_CHATS = {  # name: (file, template), each a public dataset in tests/support/data with its SOURCE.md
    "LLaMA-Factory alpaca_en_demo": (LLAMA_FACTORY / "alpaca_en_demo.json", "llama3"),
    "LLaMA-Factory glaive_toolcall_en_demo": (LLAMA_FACTORY / "glaive_toolcall_en_demo.json", "qwen2_5"),
    "torchtune alpaca_tiny": (DATA / "torchtune" / "alpaca_tiny.json", "llama3"),
}


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    """The byte tokenizer with the special tokens of Llama 3's and Qwen2.5's templates, saved as a model's is."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    chat_tokenizer(*((TEMPLATES / f"{name}.jinja").read_text() for name in ("llama3", "qwen2_5"))).save_pretrained(
        folder
    )
    return folder


def chat_run(name: str, tokenizer_dir: Path) -> list[str]:
    path, template = REAL_CHATS[name]
    return [
        "data=chat_files",
        f"data.files={path}",
        f"data.chat_template={TEMPLATES / f'{template}.jinja'}",
        f"model.tokenizer={tokenizer_dir}",
        "data.seq_len=256",
        "data.packing=true",
        "data.eval_fraction=0.1",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=2",
        "train.save_model=false",
        "train.micro_batch_size=2",
        *TWO_BLOCKS,
    ]


@pytest.mark.distributed
def test_real_chat_data_trains_to_the_same_losses_under_single_ddp_and_fsdp(chat_tokenizer_dir, tmp_path):
    from runner.engine.job import prepare_job
    from runner.engine.loop import train
    from tests.support.runs import step_losses
    from tests.support.specs import resolved_spec
    from tests.support.workers import train_in_workers

    references, specs, dirs = {}, [], []
    for name in REAL_CHATS:
        single = tmp_path / name / "single"
        single.mkdir(parents=True)
        train(prepare_job(resolved_spec([*chat_run(name, chat_tokenizer_dir), "train.grad_accum_steps=4"]), single))
        references[name] = step_losses(single)
        for strategy in ("ddp", "fsdp"):
            specs.append(
                resolved_spec(
                    [
                        *chat_run(name, chat_tokenizer_dir),
                        "hardware.nproc_per_node=2",
                        "train.grad_accum_steps=2",
                        f"strategy={strategy}",
                    ]
                )
            )
            dirs.append(tmp_path / name / strategy)
    train_in_workers(specs, dirs)
    for run_dir in dirs:
        name = run_dir.parent.name
        assert step_losses(run_dir) == pytest.approx(references[name], rel=1e-5), run_dir
        assert len(references[name]) == STEPS


@pytest.mark.signals
def test_a_chat_run_killed_and_resumed_has_the_uninterrupted_losses(chat_tokenizer_dir, tmp_path, tmp_path_factory):
    from tests.support.runs import killed_and_resumed

    args = [
        *chat_run("LLaMA-Factory glaive_toolcall_en_demo", chat_tokenizer_dir),
        "train.max_steps=8",
        "train.checkpoint_every=2",
    ]
    expected, resumed = killed_and_resumed(args, tmp_path, 5, tmp_path_factory)
    assert resumed == expected
