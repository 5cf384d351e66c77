"""Techniques, torchao-style: a frozen config per technique with its handler beside it; the lowered module
carries its config; registering a technique (a new dtype name, or another kernel path for one) works end to end."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import HalfCostMeasurer
from torch import nn

from autotune import (
    ConfigError,
    Int8DynamicLinearConfig,
    MixedPrecisionConfig,
    Technique,
    TuningConfig,
    autotune,
    plan_of,
    register_technique,
    unregister_technique,
)
from autotune.backends import dtype_names, get_backend, technique_of
from autotune.clone import clone
from autotune.plan import apply_plan, summarize

NAMES = ["0", "1", "2"]


@dataclass(frozen=True)
class RoundedLinearConfig(Technique):
    """A toy technique under a new dtype name: Linear weights rounded to multiples of `step`."""

    name: ClassVar[str] = "rounded"
    step: float = 1 / 256

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return type(module) is nn.Linear

    def lower(self, module: nn.Module, calibration) -> nn.Module:
        rounded = clone(module)
        with torch.no_grad():
            rounded.weight.copy_(torch.round(rounded.weight / self.step) * self.step)
        return rounded


@pytest.fixture
def rounded():
    technique = register_technique(RoundedLinearConfig())
    yield technique
    unregister_technique(technique)


def test_a_new_technique_is_a_dtype_configs_accept_and_the_tuner_chooses(tmp_path, rounded):
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Linear(16, 16) for _ in NAMES)).eval(), torch.randn(8, 16)
    reference = model(x).detach()

    def eval_fn(m):
        return 1 - ((m(x) - reference).norm() / reference.norm()).item()

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["rounded", "fp32"]), tolerable_loss=0.05,
                          max_trials=6, storage=f"sqlite:///{tmp_path}/t.db", study_name="toy")
    result = autotune(model, config, eval_fn, x, measurer=HalfCostMeasurer(NAMES))
    assert result.plan == {name: "rounded" for name in NAMES}
    assert plan_of(result.model, NAMES) == result.plan
    assert all(technique_of(result.model.get_submodule(name)) == rounded for name in NAMES)
    assert summarize(result.plan) == "rounded×3"
    assert result.speedup == pytest.approx(2.0)


def test_an_unregistered_dtype_name_is_refused_with_the_known_ones(rounded):
    assert "rounded" in dtype_names()
    unregister_technique(rounded)
    with pytest.raises(ConfigError, match=r"dtype.0: Input should be 'fp32', 'bf16', 'fp16' or 'int8'"):
        MixedPrecisionConfig(dtype=["rounded"])
    register_technique(rounded)     # for the fixture to remove


def test_a_technique_registered_under_an_existing_dtype_takes_the_modules_it_supports():
    default, eightbit = Int8DynamicLinearConfig(), Int8DynamicLinearConfig(reduce_range=False)
    register_technique(eightbit)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.Conv2d(1, 1, 3))
        tuned = apply_plan(model, {"0": "int8", "1": "int8"}, {"1": ((torch.randn(1, 1, 5, 5),), {})})
        assert technique_of(tuned[0]) == eightbit and tuned[0].reduce_range is False
        assert technique_of(tuned[1]).name == "int8" and plan_of(tuned, ["0", "1"]) == {"0": "int8", "1": "int8"}
    finally:
        unregister_technique(eightbit)
    assert technique_of(get_backend("int8").apply(nn.Linear(8, 8), None)) == default


def test_lowering_leaves_the_process_wide_quantized_engine_alone():
    engines = [e for e in torch.backends.quantized.supported_engines if e != "fbgemm"]
    if not engines:
        pytest.skip("no quantized engine but fbgemm here")
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engines[0]
    try:
        lowered = get_backend("int8").apply(nn.Linear(8, 8), None)
        assert torch.backends.quantized.engine == engines[0]
        assert lowered(torch.randn(2, 8)).shape == (2, 8)    # its packed weight keeps fbgemm's kernels
    finally:
        torch.backends.quantized.engine = before


def test_a_module_no_technique_supports_is_a_plan_error():
    from autotune import PlanError
    with pytest.raises(PlanError, match="no int8 technique takes a LayerNorm"):
        get_backend("int8").apply(nn.LayerNorm(4), None)
