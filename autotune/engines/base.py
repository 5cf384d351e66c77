"""The one interface every engine implements."""
from __future__ import annotations

import copy
import inspect
import re
import types
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize

from autotune.backends.base import CallInputs
from autotune.clone import clone
from autotune.engines.recorded_outputs import recording_picklable
from autotune.errors import AutotuneError, describe
from autotune.plan import Plan

# A knob that changes how a model is compiled marks the model with the mode (a plain attribute: it survives copies,
# plans applied after it and torch.save), and compiling engines read it in `runnable`. A mark rather than an engine
# option: the engines are stateless singletons, and a finalist's knobs live with its model, as the others' do.
COMPILE_MODE = "autotune_compile_mode"
# The mark of a model compiled for each input shape apart (`dynamic=False`), set where compiling it for sizes that
# vary failed: inductor's convolution lowering raised "ValueRangeError: Invalid ranges" on CvT, whose blocks run at
# three spatial sizes (plain torch.compile of it failed so too), and compiles it shape by shape.
COMPILE_STATIC = "autotune_compile_static"


# Dynamo keeps compiled entries per code object, and models of one class share their forward code: a plain MNIST
# model compiled after a finalist whose module broke the graph reused that finalist's entry, under which its
# convolutions ran eagerly (1.0x where it runs 1.7x alone), and even `isolate_recompiles` falls back to shared
# entries. So each compiled model runs a copy of its class's forward: its top frame runs only what its own compile
# made. The frames below a graph break (submodules' forwards) stay shared, so a finalist reuses what an earlier one
# compiled where the guards pass (MiniLM's tuning took 43 s with every finalist isolated, 25-36 s sharing them), with
# room for all of them: past dynamo's default limit (8 entries a code object) later finalists ran those frames
# eagerly, and were timed so. Where torch.compile lacks these options (older torch), its defaults.
RECOMPILE_LIMIT = 256
_OPTIONS = set(inspect.signature(torch.compile).parameters)

# A mark (like COMPILE_MODE) on a model whose own methods call it (transformers' `generate` calls `self(...)` at
# every step): torch.compile's wrapper compiles only the calls made to the wrapper, so such a model is compiled in
# place instead (`nn.Module.compile`), on a copy sharing its modules, and its methods' calls run compiled.
CALLS_ITSELF = "autotune_calls_itself"
# Beside it: the paths of the submodules those methods call apart from the forward (generate runs an encoder-decoder's
# encoder so, autotune.model_call), compiled in place too.
ENTRIES = "autotune_entries"


def compile_model(model: nn.Module, mode: str | None = None, *, alone: bool = False,
                  dynamic: bool | None = None, options: dict[str, Any] | None = None) -> nn.Module:
    """torch.compile(model, mode=mode, dynamic=dynamic, options=options) on a forward of the model's own, with room
    for every finalist's compiled code beside this one's. `alone`: every frame's entries apart from other models' as
    well, as in a process of its own (a peer timed beside the finalists). `options`: inductor's, for this model's
    compiles only (torch.compile takes them or a mode, not both)."""
    _give_own_forward(model)
    limits = {"isolate_recompiles": True} if alone else {"recompile_limit": RECOMPILE_LIMIT}
    settings = dict(mode=mode, dynamic=dynamic, options=options,
                    **{key: value for key, value in limits.items() if key in _OPTIONS})
    if getattr(model, CALLS_ITSELF, False):
        compiled = copy.copy(model)    # its own object, sharing the model's modules and tensors
        compiled.compile(**settings)
        for path in getattr(model, ENTRIES, ()):
            entry = compiled.get_submodule(path)
            _give_own_forward(entry)
            entry.compile(**settings)
        return compiled
    return torch.compile(model, **settings)


def _give_own_forward(model: nn.Module) -> None:
    """Points `model.forward` at a copy of its forward's code (see RECOMPILE_LIMIT's comment): the class's, or one
    set on the instance as a method of it. Any other forward set on the instance is left as it is."""
    if isinstance(model, torch.fx.GraphModule):
        # Its forward is code generated for it alone already (the fold_bn knob's fused models); one set on the
        # instance made torch.save of it, and of the compiled model, recurse without end.
        return
    forward = vars(model).get("forward")
    if forward is None:
        forward = type(model).forward
    elif isinstance(forward, types.MethodType) and forward.__self__ is model:
        forward = forward.__func__
    else:
        return
    if not isinstance(forward, types.FunctionType):
        return
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    own.__kwdefaults__ = forward.__kwdefaults__
    model.forward = types.MethodType(own, model)


def hooks_on_it_unsaved(model: nn.Module) -> str | None:
    """Why hooks set on `model` itself would be lost once it is saved, None where they are kept: torch.save pickles
    a torch.fx GraphModule as its code and modules alone."""
    if isinstance(model, torch.fx.GraphModule):
        return "the model is a torch.fx GraphModule, and torch.save of one drops the hooks this sets on it"
    return None


PARAMETRIZATIONS_MODULE = "torch.nn.utils.parametrizations"


def save_module(built: nn.Module, path: str) -> None:
    """torch.save of `built`. torch.save refuses a module with parametrizations ("Serialization of parametrized
    modules is only supported through state_dict()": weight_norm's in Wav2Vec2's positional convolution, a user's
    orthogonal Linear), so such modules are saved holding what each parametrization computes, as a plain parameter
    (remove_parametrizations, leave_parametrized=True): the same outputs, with nothing recomputed per call.
    transformers' output-capturing hooks are left out and installed again where it is loaded (recorded_outputs)."""
    if any(map(_parametrized, built.modules())):
        built = clone(built)
        for module in list(filter(_parametrized, built.modules())):
            # A class of its own first: removing a parametrization edits the module's class, which copies share
            # with the module copied (built would lose its `weight`).
            cls = type(module)
            module.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
            # weight_norm's hook reading old checkpoints' keys into its parametrization, gone now (and a local
            # function, which pickle refuses)
            hooks = getattr(module, "_load_state_dict_pre_hooks", {})
            for key in [key for key, hook in hooks.items()
                        if getattr(getattr(hook, "hook", hook), "__module__", None) == PARAMETRIZATIONS_MODULE]:
                del hooks[key]
    with recording_picklable(built):
        torch.save(built, path)


def _parametrized(module: nn.Module) -> bool:
    """Whether `module` itself holds parametrizations; a wrapper reading its attributes from the module it wraps
    (backends.cast.CastWrapper) passes parametrize.is_parametrized too."""
    return parametrize.is_parametrized(module) and "parametrizations" in dict(module.named_children())


def compile_runnable(built: nn.Module) -> nn.Module:
    """`built` under torch.compile, in the mode its knobs marked it with (default: torch.compile's own), for each
    shape apart where it is so marked (COMPILE_STATIC)."""
    return compile_model(built, getattr(built, COMPILE_MODE, None), dynamic=_dynamic(built))


def _dynamic(built: nn.Module) -> bool | None:
    return False if getattr(built, COMPILE_STATIC, False) else None


def how_to_compile(loaded: str, built: nn.Module) -> str:
    """How a user compiles what `save` wrote (`loaded`: the expression that loads it) as `runnable` does."""
    mode, dynamic = getattr(built, COMPILE_MODE, None), _dynamic(built)
    options = ", ".join(([f"mode={mode!r}"] if mode else []) + ([f"dynamic={dynamic}"] if dynamic is not None else []))
    if getattr(built, CALLS_ITSELF, False):
        how = f".compile({options})"
        entries = "".join(f"; model.get_submodule({path!r}){how}" for path in getattr(built, ENTRIES, ()))
        return f"model = {loaded}; model{how}{entries}"
    return f"torch.compile({loaded}{', ' if options else ''}{options})"


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
    keeps_model: bool    # whether what runs is the model's own class, its methods (generate) reaching the plan
    lowers_unplanned: bool   # whether modules outside the plan run in its low dtype too (lowp: the whole model)
    compiles_static_when_marked: bool   # whether `runnable` compiles a model marked COMPILE_STATIC shape by shape
    calibrates_on_batches: bool   # whether its build takes static ranges from Calibration.batches (all of them)

    def unsupported(self, plan: Plan, fp32: nn.Module) -> str | None:
        """Why this engine cannot realise `plan` on the model `fp32`, or None if it can."""

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


def why_not_written(exc: Exception) -> str:
    """Why a model could not be written, in one line: torch.export's refusal of a namedtuple output names only a
    private torch function to register it with, which no user should call."""
    if isinstance(exc, NotImplementedError) and (found := re.search(r"namedtuple class <class '([^']+)'>", str(exc))):
        return (f"NotImplementedError: torch.export cannot write a graph whose output is a namedtuple of the model's "
                f"own ({found.group(1)}); a forward returning a tuple or dict can be written")
    return describe(exc)
