"""fp32, bf16 and fp16: weights held in the dtype, floating inputs cast in and outputs cast back at the boundary."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.clone import clone
from autotune.tree import float_tensors, map_tensors


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _first_float_dtype(args: tuple, kwargs: dict) -> torch.dtype:
    floats = float_tensors((args, kwargs))
    return floats[0].dtype if floats else torch.float32


class CastWrapper(nn.Module):
    """Runs `inner` in `dtype`; callers keep seeing their own floating dtype."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner.to(dtype)
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        outer = _first_float_dtype(args, kwargs)
        out = self.inner(*cast_floats(args, self.dtype), **cast_floats(kwargs, self.dtype))
        return cast_floats(out, outer)


def _has_floating_weights(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters())


class Fp32Backend:
    name = "fp32"

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return True

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return clone(module)


class HalfBackend:
    """bf16 or fp16. On CPUs without native support both run, often far slower: the tuner measures that."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.dtype = dtype

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        if not _has_floating_weights(module):
            return False
        if device.type == "cuda" and self.dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return True

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return CastWrapper(clone(module), self.dtype)
