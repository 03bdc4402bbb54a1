"""The model as the estimate sees it: built on the meta device (shapes, no weights: seconds even for 70B).

A mixture-of-experts model's experts are read off its modules and shapes: transformers keeps each MoE layer's
routed experts as 3-D parameters (experts x rows x columns) in a module named `experts` (Qwen3-MoE, Mixtral, gpt-oss
with its biases, DeepSeek-V3), beside a router and, in Qwen2-MoE's and DeepSeek's, shared experts that every token
passes through (plain MLPs). Dense layers (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers and
decoder_sparse_step) have no `experts` module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from runner.components.fp8 import fp8_layer_names
from runner.components.modeling import blocks, build_model, build_tokenizer
from runner.config.model import ModelConfig
from runner.config.precision import PrecisionConfig
from runner.errors import SpecError

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer, as far as what it saves for backward goes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated_mlp: bool = True  # SwiGLU: gate, up and down projections
    rms_norm: bool = True  # transformers' RMSNorm computes in fp32; LayerNorm in the stream's dtype
    attention_projections: int = 3  # separate q, k and v; 1 when fused
    mlp_projections: int = 2  # separate gate and up; 1 when fused or a plain MLP
    eager_attention: bool = False  # eager attention stores the s x s scores; sdpa and flash attention do not
    softmax_fp32: bool = True  # transformers' eager attention takes the softmax in fp32, then casts it
    attention_dropout: bool = False
    hidden_dropout: bool = False


@dataclass(frozen=True)
class ExpertFacts:
    routed: int  # routed experts in each MoE layer
    top_k: int  # routed experts per token
    width: int  # an expert's intermediate size
    per_expert: int  # parameters of one routed expert: its matrices (and gpt-oss's biases)
    moe_layers: tuple[int, ...]  # the blocks with routed experts, by index
    shared_width: int = 0  # the shared experts' intermediate size, together (0: none)
    names: frozenset[str] = frozenset()  # the routed experts' parameters, by name in the model

    @property
    def parameters(self) -> int:
        """The routed experts' parameters in all MoE layers."""
        return len(self.moe_layers) * self.routed * self.per_expert

    @property
    def active(self) -> int:
        """The routed experts' parameters a token passes through: k of each MoE layer's."""
        return len(self.moe_layers) * self.top_k * self.per_expert


ROUTED = "experts"
SHARED = ("shared_expert", "shared_experts")


def expert_facts(model: nn.Module) -> Optional[ExpertFacts]:
    """The experts of a built (meta) model; None for a dense one."""
    hidden = model.config.hidden_size
    found = [
        (index, *_layer_experts(block, block_name, hidden))
        for index, (block_name, block) in enumerate(blocks(model))
        if any(_is_routed(name, module) for name, module in block.named_modules())
    ]
    if not found:
        return None
    _, routed, per_expert, width, shared_width, _ = found[0]
    config = model.config
    return ExpertFacts(
        routed=routed,
        top_k=getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", 1),
        width=width,
        per_expert=per_expert,
        moe_layers=tuple(index for index, *_ in found),
        shared_width=shared_width,
        names=frozenset(name for *_, names in found for name in names),
    )


def _is_routed(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] == ROUTED and any(p.dim() == 3 for p in module.parameters(recurse=False))


def _layer_experts(block: nn.Module, block_name: str, hidden: int) -> tuple[int, int, int, int, set[str]]:
    """A MoE block's routed experts, parameters per expert, expert width, shared experts' width and the routed
    experts' parameter names. Gated experts hold gate, up and down matrices: 3 h I parameters each."""
    from torch import nn

    name, module = next((name, module) for name, module in block.named_modules() if _is_routed(name, module))
    matrices = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    routed = matrices[0].shape[0]
    shared = [sub for sub_name, sub in block.named_modules() if sub_name.rsplit(".", 1)[-1] in SHARED]
    linear = [m for sub in shared for m in sub.modules() if isinstance(m, nn.Linear)]
    return (
        routed,
        sum(p.numel() for p in module.parameters()) // routed,
        sum(p.numel() for p in matrices) // (routed * 3 * hidden),
        sum(m.weight.numel() for m in linear) // (3 * hidden),
        {f"{block_name}.{name}.{parameter}" for parameter, _ in module.named_parameters()},
    )


@dataclass
class ModelFacts:
    model: Any  # the nn.Module, on the meta device
    model_type: str  # transformers' name for the architecture: llama, qwen2, ...
    parameters: int  # tied parameters once
    parameter_shapes: list[tuple[int, ...]]
    buffer_bytes: int
    linear_parameters: int  # in nn.Linear modules and routed experts' matrices: what autocast casts
    layers: int
    vocab: int
    layer: LayerShape
    largest_module: int  # the most parameters one module holds itself (DeepSpeed ZeRO-3 gathers per module)
    largest_parameter: int
    experts: Optional[ExpertFacts] = None  # a mixture-of-experts model's routed experts

    @property
    def active_parameters(self) -> int:
        """The parameters a token passes through: all but the routed experts, and k of each MoE layer's."""
        if self.experts is None:
            return self.parameters
        return self.parameters - self.experts.parameters + self.experts.active


_FACTS: dict[str, ModelFacts] = {}


def facts_of(model: ModelConfig) -> ModelFacts:
    """The facts of the model the run trains, built on the meta device; kept for the next call (validation and
    the fit check's re-estimates ask again)."""
    key = repr(model)
    if key not in _FACTS:
        tokenizer = build_tokenizer(model) if model.architecture else None
        try:
            module = build_model(model, tokenizer, weights=False)
        except Exception as error:  # noqa: BLE001 - whatever transformers says of the config is the user's to fix
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise SpecError(f"cannot build the model's architecture: {lines[-1] if lines else repr(error)}") from None
        if len(_FACTS) >= 8:
            _FACTS.pop(next(iter(_FACTS)))
        _FACTS[key] = model_facts(module)
    return _FACTS[key]


def meta_model(model: ModelConfig) -> nn.Module:
    return facts_of(model).model


def model_facts(model: nn.Module) -> ModelFacts:
    from torch import nn

    config = model.config
    parameters = list(model.parameters())
    hidden, heads = config.hidden_size, config.num_attention_heads
    block = _first_block(model)
    linear_names = [name for name, module in block.named_modules() if isinstance(module, nn.Linear)]

    def named(*suffixes: str) -> int:
        return sum(any(name.endswith(suffix) for suffix in suffixes) for name in linear_names)

    def dropout(*keys: str) -> bool:
        return any((getattr(config, key, 0.0) or 0.0) > 0 for key in keys)

    layer = LayerShape(
        hidden=hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        gated_mlp=named("gate_proj", "gate_up_proj", "w1", "w3") > 0,
        rms_norm=any("RMSNorm" in type(module).__name__ for module in block.modules()),
        attention_projections=3 if named("q_proj", "k_proj", "v_proj", "query", "key", "value") >= 3 else 1,
        mlp_projections=2 if named("gate_proj", "up_proj", "w1", "w3") >= 2 else 1,
        eager_attention=getattr(config, "_attn_implementation", "sdpa") == "eager",
        attention_dropout=dropout("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
        hidden_dropout=dropout("hidden_dropout_prob", "hidden_dropout", "resid_pdrop"),
    )
    linear = {id(p): p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    experts = expert_facts(model)
    routed = dict(model.named_parameters())
    linear.update({id(routed[name]): routed[name].numel() for name in (experts.names if experts else ())})
    return ModelFacts(
        model=model,
        model_type=config.model_type,
        parameters=sum(p.numel() for p in parameters),
        parameter_shapes=[tuple(p.shape) for p in parameters],
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        linear_parameters=sum(linear.values()),
        layers=config.num_hidden_layers,
        vocab=config.vocab_size,
        layer=layer,
        largest_module=max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        largest_parameter=max(p.numel() for p in parameters),
        experts=experts,
    )


def _first_block(model: nn.Module) -> nn.Module:
    return next((block for _, block in blocks(model)), model)


def fp8_linears(model: nn.Module, precision: PrecisionConfig) -> tuple[int, bool]:
    """Parameters of the linear layers precision.fp8 converts, and whether the transformer blocks' are among them."""
    if precision.fp8 is None:
        return 0, False
    names = fp8_layer_names(model, precision.fp8)
    block_names = [name for name, _ in blocks(model)]
    converted = sum(model.get_submodule(name).weight.numel() for name in names)
    return converted, any(name.startswith(block + ".") for name in names for block in block_names)


def check_causal_lm(model: ModelConfig) -> None:
    """The runner trains causal language models; an encoder such as BERT sees the tokens it should predict."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = meta_model(model).config
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not getattr(config, "is_decoder", True):
        raise SpecError(
            f"{config.model_type} is not a causal language model (an encoder: its attention sees the "
            "tokens it predicts), and the runner trains causal LMs only; choose a decoder such as "
            "model=tiny_llama or model=llama3_8b, or use task=estimate for its memory"
        )
