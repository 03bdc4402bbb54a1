"""What a run exports, read back by its readers: transformers' from_pretrained and peft's PeftModel."""

from __future__ import annotations

from pathlib import Path

import torch


def exported_logits(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the exported adapter on its base (peft), and of the merged model (transformers)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(3, 200, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model_dir / "base")
        from_adapter = PeftModel.from_pretrained(base, model_dir).eval()(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(model_dir / "merged").eval()(input_ids=tokens).logits
    return from_adapter, merged
