"""The one interface every technique implements, in the shape of torchao's `quantize_(model, config)`: a technique
is a small frozen config holding its knobs, with its handler (`lower`) beside it. The module a technique builds
carries the config, so a plan can be read back from a model without knowing the module classes."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

# What a module was called with on real data: (args, kwargs). Techniques that calibrate read it.
CallInputs = tuple[tuple[Any, ...], dict[str, Any]]

LOWERED_BY = "autotune_technique"   # the attribute a lowered module carries its technique in


class Technique:
    """Base of technique configs (frozen dataclasses). `name` is the plan's dtype name the technique realises:
    several techniques may share one (int8 has one for Linear and one for Conv2d)."""

    name: ClassVar[str]

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        """Whether this technique can run `module` on `device` at all (its speed is measured, not assumed)."""
        raise NotImplementedError

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        """The handler: a new module to use in place of `module`, sharing no weights with it."""
        raise NotImplementedError

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        """`lower`, with the result marked as built by this technique; `module` is left as it was.

        Args:
            module: the fp32 module to lower.
            calibration: what the module was called with on real data (static techniques need it).
        Returns:
            The lowered module, carrying this config in its `autotune_technique` attribute.
        """
        lowered = self.lower(module, calibration)
        setattr(lowered, LOWERED_BY, self)
        return lowered

    def __deepcopy__(self, memo: dict) -> Technique:
        return self   # configs are frozen: copies of a lowered module share theirs


def technique_of(module: nn.Module) -> Technique | None:
    """The technique that built `module`, or None for a module no technique built (it runs in fp32)."""
    return vars(module).get(LOWERED_BY)
