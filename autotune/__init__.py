"""Accuracy-driven mixed-precision autotuning for PyTorch: the fastest per-module dtype plan within tolerance.

The names below load on first use: the `autotune` command imports this package before it can take Ctrl-C over
(autotune.console), and loading them imports torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.backends import (
                                   CastConfig,
                                   Int8DynamicLinearConfig,
                                   Int8StaticConv2dConfig,
                                   Technique,
                                   register_technique,
                                   unregister_technique,
    )
    from autotune.config import LatencyInput, MixedPrecisionConfig, TuningConfig, load_config
    from autotune.errors import (
                                   AutotuneError,
                                   ConfigError,
                                   EvalFunctionError,
                                   NoTunableModulesError,
                                   PlanError,
                                   SaveError,
                                   StudyMismatchError,
    )
    from autotune.measure import LatencyStats, Measurer
    from autotune.plan import Plan, apply_plan, plan_of
    from autotune.result import Measurement, TuningResult
    from autotune.tuner import autotune

__all__ = ["autotune", "TuningConfig", "MixedPrecisionConfig", "LatencyInput", "load_config", "TuningResult",
           "Measurement", "LatencyStats", "Measurer", "Plan", "apply_plan", "plan_of", "Technique", "CastConfig",
           "Int8DynamicLinearConfig", "Int8StaticConv2dConfig", "register_technique", "unregister_technique",
           "AutotuneError", "ConfigError", "EvalFunctionError", "NoTunableModulesError", "PlanError",
           "SaveError", "StudyMismatchError"]
_MODULE_OF = {"autotune": "autotune.tuner", "TuningResult": "autotune.result", "Measurement": "autotune.result",
              **dict.fromkeys(["TuningConfig", "MixedPrecisionConfig", "LatencyInput", "load_config"],
                              "autotune.config"),
              **dict.fromkeys(["LatencyStats", "Measurer"], "autotune.measure"),
              **dict.fromkeys(["Plan", "apply_plan", "plan_of"], "autotune.plan"),
              **dict.fromkeys(["Technique", "CastConfig", "Int8DynamicLinearConfig", "Int8StaticConv2dConfig",
                               "register_technique", "unregister_technique"], "autotune.backends"),
              **dict.fromkeys(["AutotuneError", "ConfigError", "EvalFunctionError", "NoTunableModulesError",
                               "PlanError", "SaveError", "StudyMismatchError"], "autotune.errors")}

def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
