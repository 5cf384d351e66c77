"""Accuracy-driven mixed-precision autotuning for PyTorch: the fastest per-module dtype plan within tolerance."""
from autotune.config import MixedPrecisionConfig, TuningConfig
from autotune.errors import (AutotuneError, ConfigError, EvalFunctionError, NoTunableModulesError,
                             PlanError, StudyMismatchError)
from autotune.plan import Plan, apply_plan
from autotune.result import Measurement, TuningResult
from autotune.tuner import autotune

__all__ = ["autotune", "TuningConfig", "MixedPrecisionConfig", "TuningResult", "Measurement", "Plan",
           "apply_plan", "AutotuneError", "ConfigError", "EvalFunctionError",
           "NoTunableModulesError", "PlanError", "StudyMismatchError"]
