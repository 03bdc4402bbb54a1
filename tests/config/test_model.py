"""The model group's router keys (runner/config/model.py): experts_kernel=auto resolved for the device the spec runs
on, and the router's keys refused in one line where they cannot apply."""

import pytest

from runner.config.model import resolved
from runner.config.spec import validate
from runner.errors import SpecError
from tests.support.specs import composed


@pytest.mark.parametrize("accelerator, kernel", [("cpu", "eager"), ("cuda", "grouped_mm")])
def test_auto_is_grouped_mm_on_cuda_gpus_and_eager_elsewhere(accelerator, kernel):
    assert resolved(composed(["model=tiny_qwen3_moe"]).model, accelerator).experts_kernel == kernel
    assert resolved(composed(["model=tiny_llama"]).model, accelerator).experts_kernel == "auto"  # dense: none


def test_the_validated_spec_shows_the_kernel_chosen_and_keeps_one_set():
    assert validate(composed(["model=tiny_mixtral"])).model.experts_kernel == "eager"
    chosen = composed(["model=tiny_mixtral", "model.experts_kernel=batched_mm"])
    assert validate(chosen).model.experts_kernel == "batched_mm"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=tiny_llama", "model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef set for a dense model"),
        (["model=tiny_llama", "model.experts_kernel=eager"], "model.experts_kernel set for a dense model"),
        (["model=tiny_qwen3_moe", "model.router_z_loss_coef=-1"], "router_z_loss_coef=-1.0 must be >= 0"),
        (["model=tiny_qwen3_moe", "model.experts_kernel=fast"], "experts_kernel=fast is not one of auto, eager"),
    ],
)
def test_the_router_keys_are_refused_where_they_cannot_apply(overrides, message):
    with pytest.raises(SpecError, match=message):
        validate(composed(overrides))
