"""Registry of dtype backends. `register_backend` swaps the kernel path of a dtype (e.g. a GPU int8 path)."""
from __future__ import annotations

import torch

from torch import nn

from autotune.backends.base import CallInputs, DtypeBackend
from autotune.backends.cast import CastWrapper, Fp32Backend, HalfBackend
from autotune.backends.int8 import DynamicInt8Linear, Int8Backend, StaticInt8Conv2d

_BACKENDS: dict[str, DtypeBackend] = {}


def register_backend(backend: DtypeBackend) -> None:
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> DtypeBackend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend for dtype {name!r}; known: {sorted(_BACKENDS)}") from None


def dtype_of(module: nn.Module) -> str:
    """The dtype a module built by these backends runs in (anything else counts as fp32)."""
    if isinstance(module, (DynamicInt8Linear, StaticInt8Conv2d)):
        return "int8"
    if isinstance(module, CastWrapper):
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(module.dtype, "fp32")
    return "fp32"


for _backend in (Fp32Backend(), HalfBackend("bf16", torch.bfloat16), HalfBackend("fp16", torch.float16),
                 Int8Backend()):
    register_backend(_backend)

__all__ = ["CallInputs", "DtypeBackend", "dtype_of", "get_backend", "register_backend"]
