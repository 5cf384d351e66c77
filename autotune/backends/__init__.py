"""Registry of dtype backends. `register_backend` swaps the kernel path of a dtype (e.g. a GPU int8 path)."""
from __future__ import annotations

import torch

from autotune.backends.base import CallInputs, DtypeBackend
from autotune.backends.cast import Fp32Backend, HalfBackend
from autotune.backends.int8 import Int8Backend

_BACKENDS: dict[str, DtypeBackend] = {}


def register_backend(backend: DtypeBackend) -> None:
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> DtypeBackend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise KeyError(f"no backend for dtype {name!r}; known: {sorted(_BACKENDS)}") from None


for _backend in (Fp32Backend(), HalfBackend("bf16", torch.bfloat16), HalfBackend("fp16", torch.float16),
                 Int8Backend()):
    register_backend(_backend)

__all__ = ["CallInputs", "DtypeBackend", "get_backend", "register_backend"]
