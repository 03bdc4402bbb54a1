"""Tensor parallelism: Megatron's split of each transformer block over the ranks of the mesh's `tp` dimension, with
sequence parallelism between the blocks, through DTensor's `parallelize_module`.

Which linear layers split by columns and which by rows is the model's own plan, as transformers publishes it for
its architecture (`config.base_model_tp_plan`: q, k, v and the MLP's input projections by columns, the output
projections by rows). Around that plan, as torchtitan places its Llama:

    embeddings         split by vocabulary rows; their output leaves sharded along the sequence
    each block's norms sequence parallel: every rank normalises its part of the sequence (their weights replicated)
    attention, MLP     take the whole sequence (all-gathered), each rank computing its heads and its columns;
                       the row-split output projection reduce-scatters back to sequence parts
    the final norm     sequence parallel, then the whole sequence for the head
    the LM head        split by vocabulary rows, its logits gathered: the loss is the one-process loss exactly

torchao's float8 layers take the same styles, their scales taken over the whole tensors (DTensor's amax across the
ranks). A LoRA layer (peft's) splits its frozen base as the plan says, and of its adapter the matrix on the split
side (B's output columns beside a column-split base, A's input rows beside a row-split one); the rank-sized other
stays whole on every rank.

Every parameter is then a DTensor of the tp mesh, so that FSDP shards each one over the data-parallel dimensions
as a 2-D (or, with HYBRID_SHARD, 3-D) tensor, and the gradient norm is one norm over all of them. Between the blocks
the hidden states are DTensors of the whole sequence's shape, so that the model's own code (the causal mask, the
rotary positions) sees the sequence as one process does.

torch is imported inside the functions: the command line answers `--help` and `--cfg` without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from runner.components.modeling import blocks
from runner.errors import SpecError, require

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# The plan's styles placed here: by columns (output features) and by rows (input features).
STYLES = ("colwise", "rowwise")


def block_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """The style of each linear layer of a block, by its name in the block (`self_attn.q_proj`: `colwise`), from the
    model's plan; raises SpecError where the model cannot be split `tp` ways."""
    config = model.config
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise SpecError(
            f"strategy.tp_size={tp}: model_type {config.model_type} has no tensor-parallel plan in "
            f"transformers; use strategy.tp_size=1"
        )
    # (not the plan's entries outside the blocks, such as transformers 5.17's `embed_tokens` of a tied model: the
    # runner places those itself)
    in_blocks = {key.partition(".*.")[2]: style for key, style in plan.items() if ".*." in key}
    others = sorted({style for style in in_blocks.values() if style not in STYLES})
    require(
        not others,
        f"strategy.tp_size={tp}: model_type {config.model_type}'s tensor-parallel plan places layers "
        f"{' and '.join(others)}, which the runner does not; use strategy.tp_size=1",
    )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    require(
        heads % tp == 0 and kv_heads % tp == 0,
        f"strategy.tp_size={tp} does not divide the model's {heads} attention heads and {kv_heads} key-value "
        f"heads; each tensor-parallel rank computes whole heads: pick a common divisor",
    )
    return in_blocks


def parallelize_tensors(model: nn.Module, mesh: DeviceMesh) -> None:
    """Splits the model over the 1-D `mesh` (the tp dimension), in place."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    plan = block_plan(model, mesh.size())
    trains = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    for _, block in blocks(model):
        placed, replicated = {}, []
        for name, style in plan.items():
            layer = block.get_submodule(name)
            if not hasattr(layer, "base_layer"):
                placed[name] = styles[style]
                continue
            # A LoRA layer (peft's): its base split as the plan says; of the adapter's two matrices, the one on the
            # split side splits alike (B's output columns, A's input rows), the rank-sized other stays whole.
            placed[f"{name}.base_layer"] = styles[style]
            for adapter in layer.lora_A:
                if style == "colwise":
                    placed[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
                    replicated.append(layer.lora_A[adapter])
                else:
                    placed[f"{name}.lora_A.{adapter}"] = styles["rowwise"]
                    replicated.append(layer.lora_B[adapter])
        parallelize_module(
            block,
            mesh,
            {
                **placed,
                **{name: SequenceParallel() for name, module in block.named_children() if _is_norm(module)},
            },
        )
        for module in replicated:
            distribute_module(module, mesh)
        for name in {layer.rpartition(".")[0] for layer in plan}:
            block.get_submodule(name).register_forward_pre_hook(_whole_sequence, with_kwargs=True)
    # A pipeline stage holds the embeddings (the first), the final norm and head (the last), or neither.
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    final_norm = next((module for module in model.base_model.children() if _is_norm(module)), None)
    names = {module: name for name, module in model.named_modules()}
    ends = {
        embeddings: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        final_norm: SequenceParallel(),
        head: ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, {names[module]: style for module, style in ends.items() if module is not None})
    if final_norm is not None:
        final_norm.register_forward_hook(lambda module, inputs, output: output.full_tensor())
    if embeddings is not None and head is not None and model.config.tie_word_embeddings:
        model.tie_weights()  # both ends split by vocabulary rows alike: one parameter again, as the model had it
    for name, parameter in model.named_parameters():  # the styles make every parameter they split trainable
        parameter.requires_grad_(trains[name])


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Norm")


def _whole_sequence(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The attention's and the MLP's hidden states, sequence-sharded between the blocks, as the whole sequence."""
    from torch.distributed.tensor import DTensor, Replicate

    def whole(value: Any) -> Any:
        return value.redistribute(placements=[Replicate()]) if isinstance(value, DTensor) else value

    return tuple(whole(value) for value in args), {key: whole(value) for key, value in kwargs.items()}


def adapter_shapes(
    rows: int, columns: int, rank: int, style: Optional[str], tp: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A LoRA adapter's A (rank x columns) and B (rows x rank) on one tensor-parallel rank, beside a linear layer the
    plan splits in `style` (None: not split), as `parallelize_tensors` places them."""
    return (
        (rank, -(-columns // tp) if style == "rowwise" else columns),
        (-(-rows // tp) if style == "colwise" else rows, rank),
    )


def split_shapes(model: nn.Module, tp: int) -> list[tuple[int, ...]]:
    """The shape of each parameter's part on one tensor-parallel rank, in the order of model.parameters(): the
    plan's layers split by columns (dim 0) or rows (dim 1; a row-split layer's bias stays whole), the embeddings and
    the head by vocabulary rows, everything else (the norms) whole."""
    plan = block_plan(model, tp)
    split: dict[int, int] = {}  # id(parameter) -> the dimension it splits on
    for _, block in blocks(model):
        for name, style in plan.items():
            layer = block.get_submodule(name)
            split[id(layer.weight)] = 0 if style == "colwise" else 1
            if getattr(layer, "bias", None) is not None and style == "colwise":
                split[id(layer.bias)] = 0
    for vocabulary in (model.get_input_embeddings(), model.get_output_embeddings()):
        split[id(vocabulary.weight)] = 0
    shapes = []
    for parameter in model.parameters():
        shape = list(parameter.shape)
        if id(parameter) in split:
            shape[split[id(parameter)]] = -(-shape[split[id(parameter)]] // tp)
        shapes.append(tuple(shape))
    return shapes
