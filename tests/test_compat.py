"""runner/compat.py: each probe's answer for the API's newer form and for its older one, handed stand-ins with each
version's signature, methods or behaviour; and the installed libraries taking what the probes give them."""

import dataclasses
from types import SimpleNamespace
from typing import Optional

import torch

from runner.compat import (
    checkpoint_activations,
    dtensor_flattens_a_sharded_sequence,
    no_mask_cache,
    pipeline_passes_integer_tensors,
    shutdown_timeout,
)


@dataclasses.dataclass
class LaunchConfigOfTorch2_11:
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@dataclasses.dataclass
class LaunchConfigOfTorch2_12(LaunchConfigOfTorch2_11):
    shutdown_timeout: Optional[int] = None


def test_the_shutdown_timeout_is_passed_where_the_launch_config_takes_it():
    assert shutdown_timeout(600, LaunchConfigOfTorch2_12) == {"shutdown_timeout": 600}


def test_no_shutdown_timeout_is_passed_to_torch_2_11s_launch_config():
    assert shutdown_timeout(600, LaunchConfigOfTorch2_11) == {}


def test_the_installed_launch_config_accepts_what_the_probe_gives():
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, **shutdown_timeout(600))
    assert getattr(config, "shutdown_timeout", 600) == 600


def create_causal_mask_of_transformers_5_17(config, inputs_embeds, attention_mask, past_key_values, position_ids):
    pass


def create_causal_mask_of_transformers_5_24(config, inputs_embeds, attention_mask, cache, position_ids):
    pass


def test_no_cache_is_said_as_cache_to_the_masks_of_transformers_5_24():
    assert no_mask_cache(create_causal_mask_of_transformers_5_24) == {"cache": None}


def test_no_cache_is_said_as_past_key_values_to_the_masks_of_transformers_5_17():
    assert no_mask_cache(create_causal_mask_of_transformers_5_17) == {"past_key_values": None}


def test_the_installed_mask_functions_take_what_the_probe_gives():
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = LlamaConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=32,
        vocab_size=32,
        sliding_window=2,
    )
    config._attn_implementation = "eager"
    hidden = torch.zeros(1, 3, 16)
    arguments = dict(
        config=config, inputs_embeds=hidden, attention_mask=None, position_ids=torch.arange(3)[None], **no_mask_cache()
    )
    causal = create_causal_mask(**arguments)
    assert causal.shape == (1, 1, 3, 3) and causal[0, 0, 0, 1] < 0 and causal[0, 0, 2, 0] == 0
    assert create_sliding_window_causal_mask(**arguments).shape == (1, 1, 3, 3)


class ModelOfTransformers5_17:
    def __init__(self):
        self.enabled_with = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.enabled_with = gradient_checkpointing_kwargs


class ModelOfTransformers5_23(ModelOfTransformers5_17):
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        self.enabled_with = activation_checkpointing_kwargs

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        raise AssertionError("a deprecated alias in transformers 5.23")


def test_checkpointing_is_enabled_by_its_5_23_name_where_the_model_has_it():
    model = ModelOfTransformers5_23()
    checkpoint_activations(model)
    assert model.enabled_with == {"use_reentrant": False}


def test_checkpointing_is_enabled_by_its_older_name_on_transformers_5_17():
    model = ModelOfTransformers5_17()
    checkpoint_activations(model)
    assert model.enabled_with == {"use_reentrant": False}


def test_the_installed_models_checkpoint_each_block():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32, vocab_size=32)
    )
    checkpoint_activations(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


class StageOfTorch2_11:
    def get_bwd_send_ops(self, bwd_chunk_id):
        for grad, grad_recv_stage in zip(self.bwd_cache.pop(bwd_chunk_id), self.grad_send_info):
            if grad is None and grad_recv_stage is not None:
                raise RuntimeError(
                    f"[1] for chunk {bwd_chunk_id} has gradients {grad} "
                    f"and is expecting to send gradients to stage {grad_recv_stage}"
                )


class StageOfTorch2_13:
    def get_bwd_send_ops(self, bwd_chunk_id):
        return [torch.zeros(()) if grad is None else grad for grad in self.bwd_cache.pop(bwd_chunk_id)]


def test_torch_2_13s_pipeline_stages_pass_integer_tensors():
    assert pipeline_passes_integer_tensors(StageOfTorch2_13)


def test_torch_2_11s_pipeline_stages_do_not():
    assert not pipeline_passes_integer_tensors(StageOfTorch2_11)


def view_ops_flattening_sharded_dims():
    def propagate_shape_and_sharding(placements, shape, rule, mesh_sizes, strict_view=False):
        return placements, placements

    return SimpleNamespace(
        view_groups=lambda from_size, to_size: (from_size, to_size),
        propagate_shape_and_sharding=propagate_shape_and_sharding,
    )


def view_ops_of_torch_2_11():
    def propagate_shape_and_sharding(placements, shape, rule, mesh_sizes, strict_view=False):
        raise RuntimeError("Attempted to flatten multiple dimensions, with dimension 1 being sharded. ")

    return SimpleNamespace(
        view_groups=lambda from_size, to_size: (from_size, to_size),
        propagate_shape_and_sharding=propagate_shape_and_sharding,
    )


def test_torch_2_13s_dtensor_flattens_a_sharded_sequence():
    assert dtensor_flattens_a_sharded_sequence(view_ops_flattening_sharded_dims())


def test_torch_2_11s_dtensor_does_not():
    assert not dtensor_flattens_a_sharded_sequence(view_ops_of_torch_2_11())


def test_the_installed_torch_answers_both_probes():
    assert isinstance(pipeline_passes_integer_tensors(), bool)
    assert isinstance(dtensor_flattens_a_sharded_sequence(), bool)
