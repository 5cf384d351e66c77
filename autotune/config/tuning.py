"""Tuning configuration: the pydantic models behind both the Python API and YAML files.

Shaped like Intel Neural Compressor's `TuningConfig(config_set=[...], tolerable_loss=..., max_trials=...)`
so its users can switch with few edits; additions are per-module include/exclude patterns, absolute or relative
tolerance, lower-is-better metrics and a persistent Optuna storage.
"""
from __future__ import annotations

import json
import reprlib
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from autotune.backends import dtype_names
from autotune.errors import ConfigError

DEFAULT_STUDIES_DIR = Path("studies")
DEFAULT_STORAGE = f"sqlite:///{DEFAULT_STUDIES_DIR}/autotune.db"
ENGINE_NAMES = ("eager", "compiled", "inductor", "lowp")
CPU_ONLY_ENGINES = {"compiled"}   # its int8 kernels are oneDNN's x86 ones (X86InductorQuantizer)


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (str, BaseModel, dict)) else value


def _known_dtype(name: str) -> str:
    """A dtype some registered technique realises (autotune.backends.register_technique adds names)."""
    known = dtype_names()
    if name not in known:
        expected = ", ".join(repr(d) for d in known[:-1]) + f" or {known[-1]!r}" if len(known) > 1 else repr(known[0])
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return name


DtypeName = Annotated[str, AfterValidator(_known_dtype)]


# Intel Neural Compressor's fields this config has no place for, with what to write instead.
INC_FIELDS = {
    "sampler": "the search chooses its own plans (guided by measured per-module costs, then TPE): leave it out",
    "strategy": "the search chooses its own plans (guided by measured per-module costs, then TPE): leave it out",
    "accuracy_criterion": "write tolerable_loss, loss_kind ('relative' or 'absolute') and higher_is_better on "
                          "TuningConfig instead",
    "tuning_criterion": "write max_trials, timeout and objective on TuningConfig instead",
    "quant_level": "leave it out: every dtype in config_set is searched per module",
    "diagnosis": "leave it out: `autotune show` and `autotune report` give every trial's plan, score and timing",
    "precisions": "write dtype: the dtypes searched per module, fp32 among them",
    "excluded_precisions": "leave those out of dtype",
    "white_list": "write module_types (the module classes searched) or include (fnmatch globs on module names)",
    "black_list": "write exclude: fnmatch globs on module names, kept in fp32",
    "op_name_dict": "write include / exclude: fnmatch globs on module names (excluded ones stay fp32)",
    "op_type_dict": "write module_types: the module classes searched",
    "backend": "leave it out: engines (eager, compiled, inductor, lowp) says how plans may run",
    "device": "device belongs to TuningConfig",
    "tolerable_loss": "tolerable_loss belongs to TuningConfig",
    "max_trials": "max_trials belongs to TuningConfig",
}


class StrictModel(BaseModel):
    """Rejects unknown fields. `from_mapping` turns pydantic's error into ConfigError naming each bad field's
    full path; `context` reaches every nested model's validators (file configs pass their folder in it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    display_name: ClassVar[str | None] = None     # how errors name the model; default: its class name

    @classmethod
    def from_mapping(cls, data: Any, context: dict[str, Any] | None = None):
        """Validates `data` into this model.

        Raises:
            ConfigError: `data` is not a mapping of field names, or a field is unknown, missing or invalid.
        """
        name = cls.display_name or cls.__name__
        if not isinstance(data, Mapping) or not all(isinstance(key, str) for key in data):
            raise ConfigError(f"{name} must be a mapping of field names to values, got {reprlib.repr(data)}",
                              [(name, "expected a mapping")])
        try:
            return cls.model_validate(data, context=context)
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, name, INC_FIELDS, lambda loc: fields_at(cls, loc)) from None


def fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the model found at `loc` (pydantic's path of an error) under `model`, or [] where none is.
    """
    found: type[BaseModel] | None = model
    for part in (part for part in loc if not isinstance(part, int)):   # list indices name no field
        field = found.model_fields.get(part) if found else None
        found = _model_in(field.annotation) if field else None
    return list(found.model_fields) if found else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`list[X]`, `X | None`, `X`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in typing.get_args(annotation) if (found := _model_in(arg))), None)


class _RaisesConfigError(type(BaseModel)):
    """Pydantic's model metaclass, with a constructor that raises ConfigError: calling the class is the only
    path it changes, so nested configs are still validated by pydantic itself, with full paths and context."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, cls.__name__, INC_FIELDS, lambda loc: fields_at(cls, loc)) from None


class ConfigModel(StrictModel, metaclass=_RaisesConfigError):
    """A config users build in Python: its constructor raises ConfigError naming each bad field's full path."""


FUSED_EXPERTS = "FusedExperts"   # module_types' name for every fused-experts module (discovery.fused_experts)


class MixedPrecisionConfig(ConfigModel):
    """Which dtypes may be tried, on which modules. Patterns are fnmatch globs on dotted module names."""

    dtype: list[DtypeName] = Field(default_factory=lambda: ["int8", "bf16", "fp32"], min_length=1)
    module_types: list[str] = Field(
        default_factory=lambda: ["Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                                 "ConvTranspose3d", "Conv1D", "LSTM", "GRU", "LSTMCell", "GRUCell",
                                 "MultiheadAttention", FUSED_EXPERTS], min_length=1,
        description="class names (or dotted import paths) of the modules to tune; Conv1D is transformers' "
                    "GPT-style projection; a MultiheadAttention is one unit with its projections; FusedExperts is "
                    "any mixture-of-experts module holding its experts' weights stacked (transformers' *Experts "
                    "classes), tuned in bf16 / fp16")
    include: list[str] = Field(default_factory=list, description="only modules matching one of these")
    exclude: list[str] = Field(default_factory=list, description="never modules matching one of these")

    _single_to_list = field_validator("dtype", "module_types", "include", "exclude", mode="before")(
        lambda value: _as_list(value))

    @field_validator("dtype")
    @classmethod
    def _dedupe(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    @field_validator("module_types", mode="before")
    @classmethod
    def _classes_by_path(cls, value: Any) -> Any:
        """A class given itself (INC's habit: `nn.Linear`) stands for its dotted path."""
        value = [value] if isinstance(value, type) else value
        return [f"{v.__module__}.{v.__qualname__}" if isinstance(v, type) else v for v in value] \
            if isinstance(value, list) else value


def split_import_path(import_path: str) -> tuple[str, str]:
    """(module, attribute) of "package.module:attribute".

    Raises:
        ValueError: it is not of that form.
    """
    module_name, _, attribute = import_path.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{import_path!r} is not an import path of the form 'package.module:name'")
    return module_name, attribute


class LatencyInput(ConfigModel):
    """An input shape the tuned model will serve, and how much its speed-up counts in the objective.

    Give `batch` (the captured batch, its rows cut or repeated to that many) or `factory` (a callable, or in YAML
    an import path 'package.module:name', called with `kwargs`, returning inputs as example_inputs takes them);
    neither means the captured batch itself. `call` picks which of the model's recorded calls is the captured
    batch: a model eval_fn calls several ways per input, as `generate` calls it once on the prompt and then once
    per new token, is timed at each way with its weight.
    """

    batch: int | None = Field(None, ge=1)
    call: int | None = Field(None, ge=0, description="the model's call to time, as eval_fn made it (0: its first "
                             "call; example_inputs and run_fn's batches come first where given); the first 4 are "
                             "recorded. Default: the first")
    factory: str | Callable[..., Any] | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weight: float = Field(1.0, gt=0, description="its latency ratio's weight in the weighted mean of all shapes'")
    name: str | None = Field(None, min_length=1, description="default: 'batch N', or the factory's name")

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: Any) -> Any:
        if isinstance(value, str):
            split_import_path(value)    # imported only when the shape is built, where its errors name the field
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> LatencyInput:
        if self.factory is not None and (self.batch is not None or self.call is not None):
            raise ValueError("give factory, or batch and call: a factory makes its own inputs")
        if self.kwargs and self.factory is None:
            raise ValueError("kwargs belong to factory")
        return self

    def describe(self) -> str:
        """What the study records of this shape (a callable by its qualified name)."""
        factory = self.factory if isinstance(self.factory, str) or self.factory is None else \
            f"{getattr(self.factory, '__module__', '?')}:{getattr(self.factory, '__qualname__', repr(self.factory))}"
        described = {"batch": self.batch, "factory": factory, "kwargs": self.kwargs, "weight": self.weight,
                     "name": self.name}
        if self.call is not None:    # only then: the studies made before it was a field read the same
            described["call"] = self.call
        return json.dumps(described, sort_keys=True, default=str)


class TuningConfig(ConfigModel):
    config_set: list[MixedPrecisionConfig] = Field(
        default_factory=lambda: [MixedPrecisionConfig()], min_length=1,
        description="one config or a list; a module may take any dtype of every config that matches it")
    tolerable_loss: float = Field(0.01, ge=0)
    loss_kind: Literal["relative", "absolute"] = "relative"
    higher_is_better: bool = True
    max_trials: int = Field(40, ge=1, description="evaluated trials in the study, resumes included: one eval_fn "
                            "call each; a run also scores the fp32 baseline and re-scores the winner as it runs (2 "
                            "calls more, or one per finalist that misses)")
    patience: int = Field(8, ge=1, description="stop sampling after this many trials without a better passing plan")
    timeout: float | None = Field(None, gt=0, description="seconds; no new trial starts after it (after three "
                                  "quarters of it where a compiling engine is configured: the rest is the "
                                  "finalists' compiles), no compiling "
                                  "engine starts another finalist after it or where it is nearer than that engine's "
                                  "longest compile so far, and a compile still running at it is stopped (the "
                                  "baseline and module timings before the search, and the winner's timing and "
                                  "verification after it, are not cut short)")
    trial_timeout: float | None = Field(None, gt=0, description="seconds one eval_fn call may take; past it the "
                                        "trial fails and the search goes on")
    engines: list[Literal[ENGINE_NAMES]] = Field(
        default_factory=lambda: list(ENGINE_NAMES), min_length=1,
        description="how the finalists may run: eager (modules swapped), compiled (pt2e int8 + inductor, CPU), "
                    "inductor (the eager plan under torch.compile, its all-fp32 plan included) and/or lowp (the "
                    "whole model in the plan's bf16 or fp16 with fp32 islands, compiled); each finalist is timed "
                    "in each that can realise it, the fastest passing one wins. Default: every engine that runs "
                    "on the device, since which is fastest depends on the model and the machine")
    latency_inputs: list[LatencyInput] = Field(
        default_factory=list, description="the shapes latency is measured at, weighted; default: the captured batch")
    knobs: list[Literal["channels_last", "fold_bn", "autocast", "tf32", "cuda_graphs"]] = Field(
        default_factory=lambda: ["channels_last", "fold_bn", "autocast", "tf32", "cuda_graphs"],
        description="model-level knobs tried on each engine's best finalist, each kept only where re-timed "
                    "faster and re-evaluated within the tolerance (autotune.engines.knobs); a knob the model has "
                    "no use for (tf32 and cuda_graphs off CUDA, channels_last without Conv2d) is not tried")
    compile_cache: str | None = Field(
        f"{DEFAULT_STUDIES_DIR}/cache/compiled", min_length=1,
        description="folder where finalists of compiling engines and the compiler's artefacts are kept per study "
                    "and per model weights, model code and calibration batches, so a resumed study compiles nothing "
                    "again (machine-local); null: kept nowhere")
    objective: Literal["latency", "pareto"] = Field(
        "latency", description="latency: fastest plan within the tolerance; pareto: also keep the front of "
                               "latency vs accuracy loss (study.best_trials)")
    groups: list[list[str]] = Field(default_factory=list,
                                    description="lists of module names that must share one dtype")
    group_qkv: bool = Field(True, description="q/k/v projections of one attention block share a dtype")
    study_name: str | None = Field(None, min_length=1, description="default: derived from model and search space")
    storage: str = Field(DEFAULT_STORAGE, min_length=1, description="Optuna storage URL")
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = Field(None, ge=1, description="threads while measuring; default: torch's current")
    steady_allocation: bool = Field(
        True, description="fix glibc malloc's thresholds (process-wide, autotune.measure.allocator) before timing, so "
                          "a model's latency does not depend on what the process allocated before; false: the "
                          "allocator is left as it is")
    warmup: int = Field(3, ge=0)
    repeats: int = Field(15, ge=3, description="most timing rounds per comparison; fewer once it is settled")
    trial_timing: Literal["measured", "predicted"] = Field(
        "measured", description="a passing trial's latency: measured (the plan timed against fp32 in every trial) "
                                "or predicted from the per-module costs, so that only the finalists are timed "
                                "(far less measuring; close plans are then ranked by the prediction)")
    heartbeat_interval: int = Field(10, ge=1, description="seconds between a running trial's heartbeats")
    grace_period: int = Field(30, ge=2, description="a running trial this long without a heartbeat is marked "
                                                    "FAILED and its plan queued again")

    _single_to_list = field_validator("config_set", "engines", "latency_inputs", "knobs", mode="before")(
        lambda value: _as_list(value))

    @model_validator(mode="before")
    @classmethod
    def _default_engines_for_the_device(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "engines" in data:
            return data
        device = data.get("device", "cpu")
        # Only a string names a device: any other value is left to the field's own error (str() of a dict nested
        # thousands deep overflowed the stack).
        if isinstance(device, str) and not device.startswith("cpu"):
            data = {**data, "engines": [engine for engine in ENGINE_NAMES if engine not in CPU_ONLY_ENGINES]}
        return data

    @model_validator(mode="after")
    def _relative_loss_below_one(self) -> TuningConfig:
        """A relative tolerable_loss of 1 or more lets a score fall to nothing: a percentage written as a number."""
        if self.loss_kind == "relative" and self.tolerable_loss >= 1:
            message = (f"{self.tolerable_loss:g} is a relative loss of {self.tolerable_loss:.0%}: write a fraction "
                       "(0.05 for 5 %), or loss_kind: absolute for a loss in the metric's own units")
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("relative_loss", message), loc=("tolerable_loss",),
                input=self.tolerable_loss)])
        return self

    @model_validator(mode="after")
    def _pareto_times_every_trial(self) -> TuningConfig:
        """`objective: pareto` times every trial (latency is one of its objectives): `trial_timing: predicted` beside
        it was dropped without a word."""
        if self.objective == "pareto" and self.trial_timing == "predicted":
            message = ("objective: pareto times every trial, its latency being one of the objectives; leave "
                       "trial_timing out, or objective: latency to time only the finalists")
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("pareto_timing", message), loc=("trial_timing",), input=self.trial_timing)])
        return self

    @field_validator("tolerable_loss", mode="before")
    @classmethod
    def _percent_written_as_such(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().endswith("%"):
            number = value.strip().removesuffix("%").strip()
            fraction = f"{float(number) / 100:g}" if number.replace(".", "", 1).isdigit() else "0.01"
            raise ValueError(f"write the loss as a fraction: {fraction} for {value.strip()}")
        return value

    @field_validator("timeout", mode="before")
    @classmethod
    def _no_limit_is_none(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            raise ValueError("0 seconds leaves no time; for no limit (INC's 0) leave timeout out or give null")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        import torch
        try:
            torch.device(value)
        except RuntimeError as exc:
            raise ValueError(f"not a torch device: {value!r}") from exc
        return value

    def accuracy_loss(self, baseline: float, accuracy: float) -> float:
        """How much worse `accuracy` is than `baseline`, in the configured kind; negative means better."""
        drop = baseline - accuracy if self.higher_is_better else accuracy - baseline
        if self.loss_kind == "relative":
            drop = drop / abs(baseline) if baseline != 0 else (0.0 if drop <= 0 else float("inf"))
        # To 12 significant digits: a score exactly at the tolerance (1.0 to 0.99) computes as a loss of
        # 0.010000000000000009, which failed a tolerable loss of 0.01 while every log line printed 0.0100.
        return float(f"{drop:.12g}")

    def passes(self, baseline: float, accuracy: float) -> bool:
        return self.accuracy_loss(baseline, accuracy) <= self.tolerable_loss
