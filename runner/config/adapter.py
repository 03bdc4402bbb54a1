"""The `adapter` group: fine-tune a frozen base through LoRA adapters (peft), or QLoRA (LoRA on a base whose
adapted linear weights are stored in 4-bit NF4, torchao's NF4Tensor).

    adapter=none    every parameter trains (the default)
    adapter=lora    rank-r matrices A, B beside each adapted linear layer train; the base is frozen
    adapter=qlora   as lora, and the adapted layers' frozen weights are NF4: half a byte per weight plus scales

Only the adapters train: the base gets no gradients and no optimizer states, and it is kept in
precision.compute_dtype (it is never updated, so it needs no fp32 master copy). The adapters keep
precision.param_dtype (fp32 master weights under bf16 compute). A checkpoint holds the adapters and their
optimizer; the run's model/ holds the adapter in peft's format, and with adapter.merge=true the merged model.

The schema and its checks; runner/components/lora.py builds what it names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, List

from runner.config.fields import setting
from runner.errors import require

if TYPE_CHECKING:
    pass

# torchao's NF4 layout (torchtune's and the QLoRA paper's): 64 weights share a scale; 256 scales share an fp32
# scale of their own, the scales themselves stored in 8 bits.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)


class AdapterKind(str, Enum):
    none = "none"
    lora = "lora"
    qlora = "qlora"


@dataclass
class AdapterConfig:
    kind: AdapterKind = setting(
        AdapterKind.none,
        "none (every parameter trains), lora (peft's LoRA adapters) or qlora (LoRA on a 4-bit NF4 base).",
    )
    rank: int = setting(16, "The rank of each adapter's two matrices.")
    alpha: float = setting(32.0, "The adapter's update is scaled by alpha / rank.")
    dropout: float = setting(0.0, "Dropout on the adapters' input.")
    target_modules: List[str] = setting(
        [],
        "Names of the transformer blocks' linear layers to adapt (q_proj, v_proj, ...); empty: every one of them. A "
        "MoE model's routers and routed experts (3-D parameters, not linear layers) stay frozen (docs/moe.md).",
    )
    merge: bool = setting(
        False,
        "Also export the merged model (model/merged), loadable without peft, in the base model's dtype.",
    )

    @property
    def active(self) -> bool:
        return self.kind is not AdapterKind.none

    @property
    def quantized(self) -> bool:
        return self.kind is AdapterKind.qlora


def check(adapter: AdapterConfig) -> None:
    if not adapter.active:
        return
    require(adapter.rank >= 1, f"adapter.rank={adapter.rank} must be >= 1")
    require(adapter.alpha > 0, f"adapter.alpha={adapter.alpha} must be > 0")
    require(0 <= adapter.dropout < 1, f"adapter.dropout={adapter.dropout} must be in [0, 1)")
    require(importlib.util.find_spec("peft") is not None, f"adapter={adapter.kind.value} needs peft: pip install peft")
    if adapter.quantized:
        require(
            importlib.util.find_spec("torchao") is not None,
            "adapter=qlora stores the base in torchao's NF4: pip install torchao",
        )
