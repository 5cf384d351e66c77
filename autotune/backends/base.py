"""The one interface every technique implements, in the shape of torchao's `quantize_(model, config)`: a technique
is a small frozen config holding its knobs, with its handler (`lower`) beside it. The module a technique builds
carries the config, so a plan can be read back from a model without knowing the module classes."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

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

    def calibration_kept(self, calibration: CallInputs) -> CallInputs:
        """What of a module's recorded inputs `lower` reads, kept for the whole run once the module's signals are
        measured: all of it unless the technique says less (a 12-layer encoder's recorded inputs held as many
        bytes as its weights, and they grow with the batch and the sequence)."""
        return calibration

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        """`lower`, with the result marked as built by this technique; `module` is left as it was.

        Args:
            module: the fp32 module to lower.
            calibration: what the module was called with on real data (static techniques need it).
        Returns:
            The lowered module, carrying this config in its `autotune_technique` attribute.
        """
        lowered = self.lower(module, calibration)
        carry_forward_hooks(module, lowered)
        setattr(lowered, LOWERED_BY, self)
        return lowered

    def __deepcopy__(self, memo: dict) -> Technique:
        return self   # configs are frozen: copies of a lowered module share theirs


def forward_hooks(module: nn.Module, kind: str) -> dict[int, Any]:
    """The forward hooks (`kind` "") or pre-hooks ("_pre") on `module` by handle id, but torch's own weight_norm /
    spectral_norm / prune ones, which recompute a weight that lowered modules fold in (a prune hook carried over
    looked for `weight_mask` on the int8 module and failed the run). torch lists a module's hooks only in its
    attributes; where they are missing (another torch), none are found."""
    return {key: hook for key, hook in (getattr(module, f"_forward{kind}_hooks", None) or {}).items()
            if not isinstance(hook, (WeightNorm, SpectralNorm, BasePruningMethod))}


def carry_forward_hooks(module: nn.Module, lowered: nn.Module) -> None:
    """Registers the forward hooks and pre-hooks of `module` on `lowered`, which is called in its place: a user's
    hook reading or changing what the module takes or returns (features collected for a head, an adapter, a clamp)
    keeps working in the tuned model. Not where `lowered` holds them already (a wrapper around a copy of `module`)."""
    def flagged(kind: str, flag: str, key: int) -> bool:
        return key in (getattr(module, f"_forward{kind}_hooks_{flag}", None) or {})

    for kind in ("_pre", ""):
        held = {key for inner in lowered.modules() for key in forward_hooks(inner, kind)}
        for key, hook in forward_hooks(module, kind).items():
            if key in held:
                continue
            if kind:
                lowered.register_forward_pre_hook(hook, with_kwargs=flagged(kind, "with_kwargs", key))
            else:
                lowered.register_forward_hook(hook, with_kwargs=flagged(kind, "with_kwargs", key),
                                              always_call=flagged(kind, "always_called", key))


def hooked_modules(model: nn.Module) -> list[str]:
    """The names of `model`'s modules (itself: "") that carry forward hooks or pre-hooks (forward_hooks) other than
    transformers' own, which it installs at a first call to collect hidden states into that call's outputs: what
    they do stays within the forward."""
    def users(hooks: dict[int, Any]) -> bool:
        return any(not getattr(hook, "__module__", "").startswith("transformers.") for hook in hooks.values())
    return [name for name, module in model.named_modules()
            if users(forward_hooks(module, "")) or users(forward_hooks(module, "_pre"))]


def technique_of(module: nn.Module) -> Technique | None:
    """The technique that built `module`, or None for a module no technique built (it runs in fp32)."""
    return vars(module).get(LOWERED_BY)
