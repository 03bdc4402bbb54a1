"""The model and tokenizer the `model` group names (runner/config/model.py): a transformers causal LM from pretrained
weights or from an architecture config, and the built-in byte tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from runner.config.model import BYTES, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedTokenizerBase


def build_tokenizer(model: ModelConfig) -> PreTrainedTokenizerBase:
    name = model.tokenizer or model.pretrained
    if name == BYTES:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer: one token per UTF-8 byte plus three special tokens, and a plain chat template;
    nothing to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


# The byte tokenizer's chat template: a line a message, `Role: content`, each assistant turn ended by </s>, so that
# chat and preference data train on the CPU without a template file.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def build_model(
    model: ModelConfig, tokenizer: PreTrainedTokenizerBase, weights: bool = True, dtype: Optional[torch.dtype] = None
) -> nn.Module:
    """The model in fp32 (master weights stay fp32 whatever dtype a checkpoint was saved in), or in `dtype` (a
    frozen base: a checkpoint saved in that dtype stays memory-mapped); on the CPU with its weights, or without
    them on the meta device, reading no weight file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    dtype = dtype or torch.float32
    kernel = experts_kernel(model)
    if model.pretrained and weights:
        return AutoModelForCausalLM.from_pretrained(model.pretrained, dtype=dtype, **kernel)
    if model.pretrained:
        config = AutoConfig.from_pretrained(model.pretrained)
    else:
        config = architecture_config(model, tokenizer)
    if not weights:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, **kernel)
    # transformers initialises every weight of its models itself: torch's own init of each layer, before it, would
    # draw every weight twice (a third of a random 1B model's build time).
    with torch.device("cpu"), no_init_weights():
        built = AutoModelForCausalLM.from_config(config, dtype=dtype, **kernel)
    built.init_weights()
    return built


def experts_kernel(model: ModelConfig) -> dict[str, str]:
    """The transformers keyword that runs a MoE model's experts as model.experts_kernel says (resolved from `auto`
    by the spec; a dense model's stays `auto` and passes none)."""
    return {} if model.experts_kernel == "auto" else {"experts_implementation": model.experts_kernel}


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks: instances of the classes the model names as not to be split."""
    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in block_classes]


def architecture_config(model: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    from transformers import AutoConfig

    architecture = dict(model.architecture)
    return AutoConfig.for_model(
        architecture.pop("model_type"),
        **{
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            **architecture,
        },
    )
