"""Model-level knobs: whole-model changes that keep the numerics (to rounding) and may make a plan run faster.
They are tried on the finalists, beside the engines, and kept only where the re-timing says so. Each has the
shape of a technique: `supports(model)` says why it does not apply (None: it does), `apply(model)` returns a new
model, the given one untouched. On CUDA, CUDA graphs and autocast belong here as knobs of the same shape."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from autotune.clone import clone

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class Knob(Protocol):
    name: str

    def supports(self, model: nn.Module) -> str | None:
        """Why this knob does nothing for `model`, or None where it applies."""

    def apply(self, model: nn.Module) -> nn.Module:
        """A new model with the knob set (the fp32 model, before a plan is realised on it).

        Raises:
            Exception: whatever the underlying tool raises where it cannot handle the model.
        """


@dataclass(frozen=True)
class ChannelsLast:
    """4-d weights and activations in NHWC, the layout oneDNN's convolutions prefer on CPU."""
    name: str = "channels_last"

    def supports(self, model: nn.Module) -> str | None:
        return None if any(isinstance(m, nn.Conv2d) for m in model.modules()) else "the model has no Conv2d"

    def apply(self, model: nn.Module) -> nn.Module:
        return clone(model).to(memory_format=torch.channels_last)


@dataclass(frozen=True)
class FoldBatchNorm:
    """Each BatchNorm that follows a convolution or Linear folded into its weights (inference only)."""
    name: str = "fold_bn"

    def supports(self, model: nn.Module) -> str | None:
        return None if any(isinstance(m, BATCH_NORMS) for m in model.modules()) else "the model has no BatchNorm"

    def apply(self, model: nn.Module) -> nn.Module:
        from torch.fx.experimental.optimization import fuse

        return fuse(clone(model).eval())   # traces the model (torch.fx): a model it cannot trace raises


KNOBS: dict[str, Knob] = {knob.name: knob for knob in (ChannelsLast(), FoldBatchNorm())}


def with_knobs(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """`model` with the named knobs applied in order (the model itself when there are none)."""
    for name in names:
        model = KNOBS[name].apply(model)
    return model
