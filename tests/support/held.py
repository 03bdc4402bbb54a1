"""What each rank's weights, gradients and optimizer states really hold after a step, placed by the runner's own
pipeline: what the memory estimate is checked against (tests/memory/)."""

import torch

from runner.memory.breakdown import FP32, estimate
from runner.memory.model_shapes import facts_of


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the tensors (views of one flat buffer count once)."""
    storages = {}
    for tensor in tensors:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def tensors_in(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for item in value for t in tensors_in(item)] if isinstance(value, (list, tuple)) else []


def held_bytes(ranks, specs):
    """After one step, then a forward and backward: the bytes of this rank's weights, gradients and states, the
    job placed by the runner's own pipeline."""
    from runner.components.modeling import build_tokenizer
    from runner.engine.placement import place

    held = {}
    for name, spec in specs.items():
        placed = place(spec, ranks, torch.device("cpu"), build_tokenizer(spec.model))
        model, optimizer = placed.model, placed.optimizer
        deepspeed = spec.strategy.name == "deepspeed"
        batch = torch.randint(0, 259, (spec.train.micro_batch_size, 64))
        loss = model(input_ids=batch).logits.float().square().mean()
        placed.stepper.backward(loss)
        placed.stepper.step()
        loss = model(input_ids=batch).logits.float().square().mean()
        # The gradients of a second backward, held: DeepSpeed's stepper would step its engine after it.
        model.backward(loss) if deepspeed else loss.backward()
        params, buffers = list(model.parameters()), list(model.buffers())
        if deepspeed:
            zero = model.optimizer
            weights = [p.data for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
            weights += tensors_in(getattr(zero, "single_partition_of_fp32_groups", []))  # ZeRO-1/2 fp32 master
            weights += tensors_in(getattr(zero, "fp32_partitioned_groups_flat", []))  # ZeRO-3 fp32 master
            gradients = tensors_in(getattr(zero, "averaged_gradients", []))
            gradients += tensors_in(getattr(zero, "grad_partitions_flat_buffer", None))
            states = zero.optimizer.state
        else:
            weights, gradients, states = params, [p.grad for p in params if p.grad is not None], optimizer.state
        held[name] = {
            "weights": storage_bytes(weights + buffers),
            "gradients": storage_bytes(gradients),
            "optimizer states": storage_bytes(
                t for state in states.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0
            ),
        }
    return held


def assert_estimate_holds(specs, measured_by_rank):
    """Each spec's estimated weights, gradients and optimizer states against the most any rank held (rank 0 holds
    the largest shards): within padding for the torch strategies; DeepSpeed's ZeRO-1/2 keep whole gradients at
    partition edges, which the estimate bounds by the largest parameter."""
    for name, spec in specs.items():
        facts = facts_of(spec.model)
        result = estimate(spec, facts)
        estimated = {
            "weights": result.weights.bytes,
            "gradients": result.gradients.bytes,
            "optimizer states": result.optimizer_states.bytes,
        }
        for part, value in estimated.items():
            measured = max(rank[name][part] for rank in measured_by_rank)
            edges = facts.largest_parameter * FP32 if part == "gradients" and "ZeRO-" in name else 0
            assert measured <= value <= measured * 1.03 + edges + 1, (name, part, value, measured)
