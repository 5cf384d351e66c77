"""The one interface every engine implements."""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.errors import AutotuneError
from autotune.plan import Plan

# A knob that changes how a model is compiled marks the model with the mode (a plain attribute: it survives copies,
# plans applied after it and torch.save), and compiling engines read it in `runnable`. A mark rather than an engine
# option: the engines are stateless singletons, and a finalist's knobs live with its model, as the others' do.
COMPILE_MODE = "autotune_compile_mode"


# Finalists share their classes' forward code, and dynamo keeps every compiled entry of a code object together:
# past its default limit (8 entries) later finalists ran those frames eagerly, and were timed so. The entries stay
# shared (a finalist reuses what an earlier one compiled wherever the guards pass: MiniLM's tuning took 43 s with
# each finalist compiled apart, 25 s shared), with room for all of them. Where torch.compile lacks these options
# (older torch), its defaults.
RECOMPILE_LIMIT = 256
_OPTIONS = set(inspect.signature(torch.compile).parameters)


def compile_model(model: nn.Module, mode: str | None = None, *, alone: bool = False) -> nn.Module:
    """torch.compile(model, mode=mode), with room for every finalist's compiled code beside this one's. `alone`:
    compiled as in a process of its own instead, apart from every other model's code (a peer timed beside them)."""
    if alone:
        _give_own_forward(model)
    options = {"isolate_recompiles": True} if alone else {"recompile_limit": RECOMPILE_LIMIT}
    return torch.compile(model, mode=mode, **{key: value for key, value in options.items() if key in _OPTIONS})


def _give_own_forward(model: nn.Module) -> None:
    """Points `model.forward` at a copy of its class's forward code. Dynamo keeps compiled entries per code object,
    and even an isolated compile falls back to the shared entries: a plain MNIST model compiled after a finalist
    whose module broke the graph reused that finalist's entry, under which its convolutions ran eagerly (1.0x
    instead of 1.7x). A code object nothing else compiled can only run what this model's compile makes of it."""
    forward = type(model).forward
    if not isinstance(forward, types.FunctionType):
        return
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    own.__kwdefaults__ = forward.__kwdefaults__
    model.forward = types.MethodType(own, model)


def compile_runnable(built: nn.Module) -> nn.Module:
    """`built` under torch.compile, in the mode its knobs marked it with (default: torch.compile's own)."""
    return compile_model(built, getattr(built, COMPILE_MODE, None))


def how_to_compile(loaded: str, built: nn.Module) -> str:
    """How a user compiles what `save` wrote (`loaded`: the expression that loads it) as `runnable` does."""
    mode = getattr(built, COMPILE_MODE, None)
    return f"torch.compile({loaded}, mode={mode!r})" if mode else f"torch.compile({loaded})"


class EngineUnavailable(AutotuneError):
    """An engine cannot realise a plan on this model (e.g. export failed on data-dependent control flow)."""


@dataclass
class Calibration:
    """What the model and its modules really saw: whole-model batches (several, for static ranges) and each
    module's inputs on the first of them; `variants` keeps modules an engine lowered once, for reuse."""
    batches: list[CallInputs]
    modules: dict[str, CallInputs]
    variants: dict = field(default_factory=dict)


class Engine(Protocol):
    name: str

    def unsupported(self, plan: Plan) -> str | None:
        """Why this engine cannot realise `plan`, or None if it can."""

    def build(self, fp32: nn.Module, plan: Plan, calibration: Calibration) -> nn.Module:
        """`plan` realised on a copy of `fp32`, in reference numerics: what accuracy is measured on.

        Raises:
            EngineUnavailable: the model cannot go through this engine.
        """

    def runnable(self, built: nn.Module) -> nn.Module:
        """What runs in deployment and is timed: `built` itself, or compiled."""

    def save(self, built: nn.Module, inputs: CallInputs, path: str) -> str:
        """Writes `built` to `path`; returns how to load it."""

    def load(self, path: str) -> nn.Module:
        """What `save` wrote, as `build` returned it."""
