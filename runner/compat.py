"""The torch and transformers APIs that differ between the versions the runner supports, from pyproject's floors
(torch 2.11, transformers 5.17: what the GPU machines ship) to the newest releases. Each is found here, and only
here, by probing the API itself (its signature, its attributes, its source, its answer to a small case), never by
comparing version strings; the call sites ask these functions. Each probe takes the thing it probes as an argument,
defaulting to the library's own, so that both of its answers are tested. Torch is imported inside the functions:
`run --help` and `--cfg` import none of it.

The other torch and transformers names that runner/ and bench/ use, and the keywords the runner passes them, were
found alike from the floors to torch 2.14.1 and transformers 5.24.0: docs/testing.md says what was checked.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Optional


def shutdown_timeout(seconds: int, launch_config: Optional[type] = None) -> dict[str, int]:
    """LaunchConfig's keyword for how long the elastic agent waits, once it has passed a SIGTERM on to the workers,
    before it kills them: `shutdown_timeout` from torch 2.12 on. Torch 2.11's agent has no such setting and waits a
    fixed 30 s (PContext.close's default): there, workers whose step and checkpoint take longer are killed, and a
    resume starts from the checkpoint before."""
    if launch_config is None:
        from torch.distributed.launcher.api import LaunchConfig as launch_config
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in inspect.signature(launch_config).parameters else {}


def no_mask_cache(mask_function: Optional[Callable] = None) -> dict[str, None]:
    """The keyword, given None, that tells transformers' mask functions (create_causal_mask and its sliding-window
    kin, alike in each version) there is no key-value cache: `cache` from transformers 5.24 on, `past_key_values`
    before."""
    if mask_function is None:
        from transformers.masking_utils import create_causal_mask as mask_function
    return {"cache" if "cache" in inspect.signature(mask_function).parameters else "past_key_values": None}


def checkpoint_activations(model) -> None:
    """transformers' non-reentrant checkpointing of each block of a model: `activation_checkpointing_enable` from
    transformers 5.23 on (`gradient_checkpointing_enable` is a deprecated alias there), `gradient_checkpointing_enable`
    before."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def pipeline_passes_integer_tensors(stage_class: Optional[type] = None) -> bool:
    """Whether torch's pipeline stages pass on tensors that take no gradient, as the integer labels and positions the
    runner sends from stage to stage: from torch 2.13 on. Torch 2.11's and 2.12's make every tensor a stage receives
    require a gradient, which an integer tensor cannot, and raise on a received input that got none ("... is
    expecting to send gradients to stage ...")."""
    if stage_class is None:
        from torch.distributed.pipelining import PipelineStage as stage_class
    return "is expecting to send gradients" not in inspect.getsource(stage_class.get_bwd_send_ops)


def dtensor_flattens_a_sharded_sequence(view_ops=None) -> bool:
    """Whether DTensor views a (batch, sequence, features) tensor split along its sequence as (batch x sequence,
    features), as F.linear does, without gathering it: torch 2.13's does (its split becomes a _StridedShard); torch
    2.11's refuses ("Attempted to flatten multiple dimensions, with dimension 1 being sharded"). LoRA's B does that,
    beside a layer that tensor parallelism splits by rows."""
    from torch.distributed.tensor import Shard

    if view_ops is None:
        from torch.distributed.tensor._ops import _view_ops as view_ops
    batch_by_sequence = view_ops.view_groups((2, 4, 3), (8, 3))
    try:
        view_ops.propagate_shape_and_sharding([Shard(1)], (2, 4, 3), batch_by_sequence, (2,), strict_view=True)
    except RuntimeError:
        return False
    return True


def cache_keyword(model_class: type) -> str:
    """The keyword a transformers model's forward takes its key-value cache by: `cache` from transformers 5.24 on
    (which warns of `past_key_values`), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def lm_eval_yaml(path: Path) -> dict[str, Any]:
    """A task YAML file as lm-eval reads it, with its includes and !function tags: lm-eval 0.4.13 reads them in
    lm_eval.tasks._yaml_loader, and has no public function for it."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path)
