"""The registry of techniques. A plan's dtype name ("int8", "bf16", ...) stands for every technique registered
under it; a module takes the newest registered one that supports it. `register_technique` adds a technique,
for an existing dtype (another kernel path) or a new one (which configs then accept by name)."""
from __future__ import annotations

import torch
from torch import nn

from autotune.backends.base import CallInputs, Technique, technique_of
from autotune.backends.cast import CastConfig, KeepFp32Config, held_dtype
from autotune.backends.int8_attention import Int8DynamicMHAConfig
from autotune.backends.int8_conv import Int8StaticConv1dConfig, Int8StaticConv2dConfig
from autotune.backends.int8_linear import Int8DynamicConv1DConfig, Int8DynamicLinearConfig
from autotune.backends.int8_rnn import Int8DynamicRNNConfig
from autotune.errors import PlanError


class DtypeBackend:
    """A dtype name and the techniques registered under it, newest first."""

    def __init__(self, name: str):
        self.name = name
        self.techniques: list[Technique] = []

    def technique_for(self, module: nn.Module, device: torch.device) -> Technique | None:
        return next((t for t in self.techniques if t.supports(module, device)), None)

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return self.technique_for(module, device) is not None

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        """`module` lowered by the first technique that supports it on its own device.

        Raises:
            PlanError: no technique of this dtype takes the module.
        """
        technique = self.technique_for(module, _device_of(module))
        if technique is None:
            raise PlanError(f"no {self.name} technique takes a {type(module).__name__}")
        return technique.apply(module, calibration)


_BACKENDS: dict[str, DtypeBackend] = {}


def register_technique(technique: Technique) -> Technique:
    """Adds `technique` under its dtype name (a new name becomes a dtype configs accept); returns it.

    Modules it supports take it ahead of the techniques registered before it under that name.
    """
    _BACKENDS.setdefault(technique.name, DtypeBackend(technique.name)).techniques.insert(0, technique)
    return technique


def unregister_technique(technique: Technique) -> None:
    """Removes a registered technique; a dtype left without techniques is no longer known."""
    backend = _BACKENDS[technique.name]
    backend.techniques.remove(technique)
    if not backend.techniques:
        del _BACKENDS[technique.name]


def get_backend(name: str) -> DtypeBackend:
    """The techniques registered under dtype `name`.

    Raises:
        KeyError: no technique is registered under `name`.
    """
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend for dtype {name!r}; known: {sorted(_BACKENDS)}") from None


def dtype_names() -> list[str]:
    """The known dtype names, in the order they were first registered."""
    return list(_BACKENDS)


def dtype_of(module: nn.Module) -> str:
    """The dtype a module built by a technique runs in; any other module counts as fp32."""
    technique = technique_of(module)
    return "fp32" if technique is None else technique.name


def calibration_kept(module: nn.Module, dtypes: list[str], calibration: CallInputs) -> CallInputs:
    """What of `module`'s recorded inputs the techniques that lower it in `dtypes` read (Technique.calibration_kept):
    none where none reads any, all of it where they read different parts."""
    device = _device_of(module)
    techniques = [technique for dtype in dtypes if dtype in _BACKENDS
                  if (technique := _BACKENDS[dtype].technique_for(module, device)) is not None]
    read = [kept for kept in (technique.calibration_kept(calibration) for technique in techniques) if any(kept)]
    if not read:
        return (), {}
    return read[0] if len(read) == 1 else calibration


def _device_of(module: nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


for _technique in (KeepFp32Config(), CastConfig(torch.bfloat16), CastConfig(torch.float16), Int8StaticConv2dConfig(),
                   Int8StaticConv1dConfig(), Int8DynamicLinearConfig(), Int8DynamicConv1DConfig(),
                   Int8DynamicRNNConfig(), Int8DynamicMHAConfig()):
    register_technique(_technique)

__all__ = ["CallInputs", "CastConfig", "DtypeBackend", "Int8DynamicConv1DConfig", "Int8DynamicLinearConfig",
           "Int8DynamicMHAConfig", "Int8DynamicRNNConfig", "Int8StaticConv1dConfig", "Int8StaticConv2dConfig",
           "KeepFp32Config", "Technique", "calibration_kept", "dtype_names", "dtype_of", "get_backend", "held_dtype",
           "register_technique", "technique_of", "unregister_technique"]
