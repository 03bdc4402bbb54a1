"""LoRA and QLoRA (runner/config/adapter.py): the adapters injected with peft, the base's adapted weights stored
as torchao's NF4, the adapters switched off (DPO's reference), and the export of the adapter and of the merged model."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from runner.components.modeling import blocks
from runner.config.adapter import NF4_BLOCK, NF4_SCALER_BLOCK, AdapterConfig
from runner.errors import did_you_mean, require

if TYPE_CHECKING:
    import torch
    from torch import nn


PEFT_PREFIX = "base_model.model."


def block_linear_names(model: nn.Module) -> list[str]:
    """The distinct names of the linear layers inside the transformer blocks (q_proj, ..., down_proj), in order."""
    from torch import nn

    names: dict[str, None] = {}
    for _, block in blocks(model):
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                names[name.rsplit(".", 1)[-1]] = None
    return list(names)


def targets(adapter: AdapterConfig, model: nn.Module) -> list[str]:
    """The linear layers the adapter adapts; an unknown name is an error naming the ones there are."""
    known = block_linear_names(model)
    for name in adapter.target_modules:
        require(
            name in known,
            f"adapter.target_modules: {name} is not a linear layer of the model's blocks, "
            f"which has {', '.join(known)}{did_you_mean(name, known, '')}",
        )
    return list(adapter.target_modules) or known


def lora_config(adapter: AdapterConfig, model: nn.Module):
    from peft import LoraConfig

    return LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=targets(adapter, model),
        bias="none",
        task_type="CAUSAL_LM",
    )


def nf4_fits(shape: tuple[int, ...], shards: int) -> bool:
    """Whether torchao's NF4 can hold a weight of this shape split into `shards` equal parts: each part a whole
    number of scale blocks."""
    rows = shape[0]
    elements = rows * (shape[1] if len(shape) > 1 else 1)
    return rows % shards == 0 and elements % (NF4_BLOCK * NF4_SCALER_BLOCK * shards) == 0


def add_adapter(model: nn.Module, adapter: AdapterConfig, adapter_dtype: torch.dtype, shards: int) -> str:
    """Adds the adapters in `adapter_dtype` to a base built in the dtype it is kept in, and freezes the base; for
    QLoRA the adapted layers' weights go to NF4 when they split into `shards` whole blocks (the others stay as
    they are). Returns what was done, for the log."""
    import torch
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    adapted = targets(adapter, model)
    inject_adapter_in_model(lora_config(adapter, model), model)
    trainable = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)
        if parameter.requires_grad:
            parameter.data = parameter.data.to(adapter_dtype)
            trainable += parameter.numel()
    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    with torch.no_grad():
        in_nf4 = sum(_to_nf4(layer.get_base_layer(), shards) for layer in layers) if adapter.quantized else 0
    total = sum(p.numel() for p in model.parameters())
    base_dtype = str(layers[0].get_base_layer().weight.dtype).removeprefix("torch.")  # there is always a target
    described = (
        f"{adapter.kind.value}: rank {adapter.rank}, alpha {adapter.alpha:g} on {len(layers)} linear layers "
        f"({', '.join(adapted)}); {trainable:,} of {total:,} parameters train "
        f"({100 * trainable / total:.2f}%)"
    )
    if adapter.quantized:
        return described + f"; the frozen base in {base_dtype}, {in_nf4} of {len(layers)} adapted weights in NF4"
    return described + f"; the frozen base in {base_dtype}"


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The model's LoRA layers pass their base layer's output alone: the frozen base, as peft's disable_adapter
    gives it, without peft's switching of requires_grad, which a sharded or wrapped model holds on to."""
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import to_nf4

    return to_nf4(weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK)


def _to_nf4(linear: nn.Module, shards: int) -> bool:
    from torch import nn

    weight = linear.weight
    if weight.is_meta or not nf4_fits(tuple(weight.shape), shards):
        return False
    linear.weight = nn.Parameter(_nf4(weight), requires_grad=False)
    return True


def export(
    directory: Path, adapter: AdapterConfig, trained: dict[str, torch.Tensor], model: nn.Module, base_path: str
) -> None:
    """The adapter in peft's format (adapter_config.json, adapter_model.safetensors, fp32), loadable with
    PeftModel.from_pretrained onto the base at `base_path`. `model` holds the adapters (their names, its config)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = model.peft_config["default"]
    config.base_model_name_or_path = base_path
    config.save_pretrained(str(directory))
    state = get_peft_model_state_dict(model, state_dict=trained, save_embedding_layers=False)
    save_file(
        {PEFT_PREFIX + name: tensor.detach().float().contiguous() for name, tensor in state.items()},
        str(directory / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )


def export_merged(
    directory: Path, adapter: AdapterConfig, trained: dict[str, torch.Tensor], base: nn.Module, shards: int
) -> None:
    """The base with the adapters merged into its weights, computed in fp32 from the base as training saw it (QLoRA:
    its NF4 weights dequantized) and saved in the base model's own dtype."""
    import torch
    from peft import get_peft_model

    saved_dtype = getattr(base.config, "dtype", None) or torch.float32
    saved_dtype = getattr(torch, saved_dtype) if isinstance(saved_dtype, str) else saved_dtype
    if adapter.quantized:
        _nf4_round_trip(base, adapter, shards)
    with warnings.catch_warnings():  # peft asks the model a question transformers renamed
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(base.float(), lora_config(adapter, base))
    loaded = peft_model.base_model.model.load_state_dict(
        {name: tensor.float() for name, tensor in trained.items()}, strict=False
    )
    assert not loaded.unexpected_keys, f"adapter tensors the base has no place for: {loaded.unexpected_keys[:3]}"
    peft_model.merge_and_unload().to(saved_dtype).save_pretrained(directory)


def _nf4_round_trip(model: nn.Module, adapter: AdapterConfig, shards: int) -> None:
    """The adapted layers' weights as QLoRA training saw them: quantized to NF4 and back."""
    import torch

    names = set(targets(adapter, model))
    with torch.no_grad():
        for _, block in blocks(model):
            for name, module in block.named_modules():
                if name.rsplit(".", 1)[-1] in names and nf4_fits(tuple(module.weight.shape), shards):
                    module.weight.copy_(_nf4(module.weight).get_original_weight())
