"""fp32 kept as is, and bf16 / fp16 by casting: weights held in the dtype, floating inputs cast in and outputs
cast back at the module boundary."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from autotune.backends.base import CallInputs, Technique
from autotune.clone import clone
from autotune.tree import float_tensors, map_tensors

HALF_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def held_dtype(model: nn.Module) -> str:
    """The dtype name most of a model's floating parameters hold: what a plan's "fp32" (the module as it is)
    computes in for a model handed over in bf16 or fp16."""
    return HALF_NAMES.get(_parameters_dtype(model), "fp32")


def _parameters_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype most of a module's floating parameters hold; None where it has none."""
    counts = Counter(p.dtype for p in module.parameters() if p.is_floating_point())
    return counts.most_common(1)[0][0] if counts else None


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _first_float_dtype(args: tuple, kwargs: dict) -> torch.dtype:
    floats = float_tensors((args, kwargs))
    return floats[0].dtype if floats else torch.float32


class CastWrapper(nn.Module):
    """Runs `inner` in `dtype`; its outputs come back in the floating dtype the module held (`outer`), as the
    module's own did, whatever dtype the caller fed it: a parent that casts its input to the child's weight dtype
    (`x.to(self.fc1.weight.dtype)`, as transformers' code does) feeds it bf16, and the modules after it still hold
    fp32. Attributes the wrapper lacks are read from `inner`: parents read their children's
    (`self.wo.weight.dtype` in T5, `self.conv1.stride` in Whisper, `self.linear1.weight` in torch's own
    TransformerEncoderLayer)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.outer = _parameters_dtype(inner)    # None: the caller's dtype
        self.inner = inner.to(dtype)
        self.dtype = dtype

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or name == "inner":   # copy and pickle protocols are the wrapper's own
                raise
            return getattr(super().__getattr__("inner"), name)

    def forward(self, *args, **kwargs):
        outer = self.outer or _first_float_dtype(args, kwargs)
        out = self.inner(*cast_floats(args, self.dtype), **cast_floats(kwargs, self.dtype))
        return cast_floats(out, outer)


@dataclass(frozen=True)
class KeepFp32Config(Technique):
    """The module as it is: the fallback every module has."""

    name: ClassVar[str] = "fp32"

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return True

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return clone(module)

    def calibration_kept(self, calibration: CallInputs) -> CallInputs:
        return (), {}


@dataclass(frozen=True)
class CastConfig(Technique):
    """bf16 or fp16 by casting at the module boundary. On CPUs without native support both run, often far
    slower than fp32: the tuner measures that and prunes."""

    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.dtype not in HALF_NAMES:
            raise ValueError(f"CastConfig casts to {sorted(HALF_NAMES.values())}, not {self.dtype}")

    @property
    def name(self) -> str:
        return HALF_NAMES[self.dtype]

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        # A module handed over in this dtype already is what its "fp32" (kept as it is) runs: casting to it would
        # only add the wrapper, a trial spent on the same model.
        if _parameters_dtype(module) in (None, self.dtype):
            return False
        if device.type == "cuda" and self.dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return True

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return CastWrapper(clone(module), self.dtype)

    def calibration_kept(self, calibration: CallInputs) -> CallInputs:
        return (), {}
