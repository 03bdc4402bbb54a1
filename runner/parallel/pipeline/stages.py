"""A Llama-family transformers causal LM cut into pipeline stages for training (runner/parallel/pipeline/layout.py says
which): this rank keeps its stages' decoder layers and drops the others', and each of its stages runs as a module
of its own, which torch.distributed.pipelining's schedule calls and FSDP shards as a root.

The model object stays what the rest of the runner holds (its config, class, parameter names, state dict): a stage
module refers to the model's own submodules, so that `model.layers.7.mlp.up_proj.weight` is named the same on
the rank that holds it as in the whole model, and checkpoints and exports merge the stages' state dicts as they are.

Between stages pass the hidden states with the labels and the rows' positions and attention mask (integer tensors
without gradients), so that the last stage computes the summed loss inside its forward, as the whole model does
(runner/engine/loss.py): chunked, without the batch's logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from runner.compat import no_mask_cache
from runner.errors import SpecError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The last stage's loss: (the LM head, the final hidden states, the labels) -> the summed loss
HeadLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
# The parameter names of the two ends of tied embeddings, which the first stage and the last hold
INPUT_EMBEDDINGS, OUTPUT_EMBEDDINGS = "model.embed_tokens.weight", "lm_head.weight"


def decoder_of(model: nn.Module, use: str) -> nn.Module:
    """The model's decoder (model.model), checked to be a Llama-family one that stages can cut."""
    decoder = getattr(model, "model", None)
    if decoder is None or not all(hasattr(decoder, part) for part in DECODER_PARTS) or not hasattr(model, "lm_head"):
        raise SpecError(
            f"{use} needs a Llama-family causal LM (model.model.embed_tokens, layers, norm, rotary_emb "
            f"and model.lm_head); {type(model).__name__} is not one"
        )
    return decoder


def layer_attention_type(layer: nn.Module) -> str:
    return getattr(layer, "attention_type", "full_attention")


def attention_masks(
    config,
    hidden: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    position_ids: torch.Tensor,
    layers: list[nn.Module],
) -> dict:
    """The 4D masks (or None where the attention kernel is causal by itself) by layer attention type, made as the
    model's own forward makes them; sliding-window layers (Qwen2, Mistral-style) get theirs."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    arguments = dict(
        config=config, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids, **no_mask_cache()
    )
    masks = {"full_attention": create_causal_mask(**arguments)}
    if any(layer_attention_type(layer) == "sliding_attention" for layer in layers):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**arguments)
    return masks


def run_layers(
    config,
    layers: list[nn.Module],
    rotary_emb: nn.Module,
    hidden: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """The hidden states through decoder layers, with the masks and rotary embeddings the model's forward gives
    them."""
    masks = attention_masks(config, hidden, attention_mask, position_ids, layers)
    position_embeddings = rotary_emb(hidden, position_ids=position_ids)
    for layer in layers:
        hidden = layer(
            hidden,
            attention_mask=masks[layer_attention_type(layer)],
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
    return hidden


class TrainingStage(nn.Module):
    """One stage of the model in training. The first takes (input_ids, labels, position_ids, attention_mask), the
    others (hidden_states, labels, position_ids, attention_mask); each passes on the hidden states with the rest,
    and the last returns the summed loss of its rows (shape [1]). Packed rows (`packed`) attend by their positions,
    as the whole model's forward is given them, with no attention mask. Under tensor parallelism (`tp_mesh`) the
    hidden states between blocks are sequence-sharded DTensors: a stage passes on its rank's part of the sequence,
    and the next stage's rank with the same tensor-parallel place takes it up as that part again."""

    def __init__(
        self,
        model: nn.Module,
        layers: range,
        first: bool,
        last: bool,
        packed: bool,
        loss: HeadLoss,
        tp_mesh: Optional[DeviceMesh] = None,
    ):
        super().__init__()
        decoder = model.model
        # Attribute names as in the model, so that FSDP's units and the parameters keep the model's names.
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = decoder.embed_tokens
        self.model.layers = nn.ModuleDict({str(index): decoder.layers[str(index)] for index in layers})
        self.model.rotary_emb = decoder.rotary_emb
        if last:
            self.model.norm = decoder.norm
            self.lm_head = model.lm_head
        self.config, self.first, self.last, self.packed, self.loss = model.config, first, last, packed, loss
        self.tp_mesh = tp_mesh
        self._no_split_modules = model._no_split_modules  # FSDP's wrap policy names the blocks from it

    def forward(
        self, inputs: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor
    ):
        if self.first:
            hidden = self.model.embed_tokens(inputs)
        elif self.tp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            hidden = DTensor.from_local(inputs, self.tp_mesh, [Shard(1)], run_check=False)
        else:
            hidden = inputs
        hidden = run_layers(
            self.config,
            list(self.model.layers.values()),
            self.model.rotary_emb,
            hidden,
            None if self.packed else attention_mask,
            position_ids,
        )
        if not self.last:  # (copies: FSDP's backward hooks cannot sit on views, such as the inputs or a local part)
            hidden = hidden.to_local().clone() if self.tp_mesh is not None else hidden
            return hidden, labels.clone(), position_ids.clone(), attention_mask.clone()
        return torch.stack([self.loss(self.lm_head, self.model.norm(hidden), labels)])


def cut_into_stages(
    model: nn.Module,
    stages: list[int],
    bounds: list[tuple[int, int]],
    packed: bool,
    loss: HeadLoss,
    tp_mesh: Optional[DeviceMesh] = None,
) -> list[TrainingStage]:
    """This rank's stages of `model`, whose other layers (and embeddings or head, where another rank holds them)
    are dropped from it: the model keeps only this rank's weights, under their own names."""
    decoder = decoder_of(model, "strategy.pp_size > 1")
    held = {index for stage in stages for index in range(*bounds[stage])}
    decoder.layers = nn.ModuleDict({str(index): layer for index, layer in enumerate(decoder.layers) if index in held})
    last = len(bounds) - 1
    modules = [
        TrainingStage(model, range(*bounds[stage]), stage == 0, stage == last, packed, loss, tp_mesh)
        for stage in stages
    ]
    if 0 not in stages:
        decoder.embed_tokens = None
    if last not in stages:
        decoder.norm = None
        model.lm_head = None
    return modules
