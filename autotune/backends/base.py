"""The one interface every dtype backend implements (one small module per dtype, like torchao's configs)."""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

# What a module was called with on real data: (args, kwargs). Backends that calibrate read it.
CallInputs = tuple[tuple[Any, ...], dict[str, Any]]


class DtypeBackend(Protocol):
    name: str

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        """Whether this backend can run `module` on `device` at all (speed is measured, not assumed)."""

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        """A new module to use in place of `module`, sharing no weights with it; `module` is left as it was."""
