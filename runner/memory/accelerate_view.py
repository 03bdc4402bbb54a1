"""accelerate `estimate-memory`'s training table, which `run task=estimate` prints beside its own estimate."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def _base_model(model: nn.Module) -> nn.Module:
    """What accelerate's create_empty_model builds: AutoModel, with no LM head, in fp32, without weights."""
    import torch
    from transformers import AutoModel

    with torch.device("meta"):
        return AutoModel.from_config(model.config, dtype=torch.float32)


def accelerate_sizes(model: nn.Module) -> dict[str, tuple[int, int, int, int]]:
    """accelerate `estimate-memory`'s training table (commands/estimate.py, estimate_training_usage), per dtype:
    model, gradients, backward pass, optimizer step, from b = the bytes of the base model's parameters and
    buffers in fp32 (utils/modeling.py, compute_module_sizes). float32: b, b, 2b, 4b; float16: b, b + b//2, 2b, 2b."""
    base = _base_model(model)
    size = sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    return {"float32": (size, size, 2 * size, 4 * size), "float16": (size, size + size // 2, 2 * size, 2 * size)}


def accelerate_bytes(size: float) -> str:
    """accelerate's convert_bytes: its MB and GB are MiB and GiB."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def format_accelerate_view(model: nn.Module) -> str:
    base = _base_model(model)
    rows = [["dtype", "Model", "Gradients", "Backward pass", "Optimizer step"]]
    rows += [[dtype, *map(accelerate_bytes, sizes)] for dtype, sizes in accelerate_sizes(model).items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        [
            f"accelerate estimate-memory's view ({type(base).__name__}, no LM head: "
            f"{sum(p.numel() for p in base.parameters()):,} parameters, with its buffers; Adam, batch size 1, no "
            "activations, one device; MB and GB are MiB and GiB):",
            *("  " + "   ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows),
        ]
    )
