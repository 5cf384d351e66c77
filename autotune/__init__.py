"""Accuracy-driven mixed-precision autotuning for PyTorch: the fastest per-module dtype plan within tolerance."""
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
           "StudyMismatchError"]
