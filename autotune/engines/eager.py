"""The eager engine: each module of the plan swapped for its technique's module, the rest of the model as is."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.engines.base import Calibration, save_module
from autotune.plan import Plan, apply_plan


@dataclass(frozen=True)
class EagerEngine:
    name: str = "eager"
    keeps_model: bool = True
    lowers_unplanned: bool = False
    compiles_static_when_marked: bool = False
    calibrates_on_batches: bool = False

    def unsupported(self, plan: Plan, fp32: nn.Module) -> str | None:
        return None

    def build(self, fp32: nn.Module, plan: Plan, calibration: Calibration) -> nn.Module:
        return apply_plan(fp32, plan, calibration.modules, calibration.variants)

    def runnable(self, built: nn.Module) -> nn.Module:
        return built

    def save(self, built: nn.Module, inputs: CallInputs, path: str) -> str:
        save_module(built, path)
        return "torch.load(path, weights_only=False), where autotune is importable (it holds autotune's modules)"

    def load(self, path: str) -> nn.Module:
        return torch.load(path, weights_only=False)
