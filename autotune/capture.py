"""Recording what a model and its modules are called with, so tuning can run them without the user's data."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.config.tuning import LatencyInput
from autotune.errors import ConfigError, EvalFunctionError, describe
from autotune.fused_paths import children_called_as_modules
from autotune.model_call import ModelCall, call, entries_of, linked, same_values, snapshot
from autotune.tree import map_tensors, tensors

log = logging.getLogger("autotune")


def detach_clone(value: Any) -> Any:
    """Copies of the tensors in `value`, as normal tensors even when recorded inside the user's
    `torch.inference_mode()` (an inference tensor cannot go through torch.export or autograd later), and of the
    state objects in it as they were at the call (`model_call.snapshot`)."""
    with torch.inference_mode(False):
        return map_tensors(value, lambda t: t.detach().clone(), snapshot)


class _Captured(BaseException):
    """Unwinds eval_fn once the first batch is recorded (BaseException so a user's `except Exception` lets it by)."""


def as_call_inputs(example_inputs: Any, field: str = "example_inputs") -> CallInputs:
    """Accepts a tensor, a tuple of positional args, a dict of keyword args or an (args, kwargs) pair.

    Raises:
        ConfigError: anything else, naming `field`.
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if (isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[0], tuple)
            and isinstance(example_inputs[1], dict)):
        return example_inputs
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    message = f"must be a tensor, tuple, dict or (args, kwargs); got {type(example_inputs).__name__}"
    raise ConfigError(f"{field} {message}", [(field, message)])


CALIBRATION_BATCHES = 4   # whole-model batches kept for static activation ranges (the compiled engine)


@dataclass
class HowCalled:
    """What eval_fn's calls of the model were like: the model's own methods that made them (as "Class.method"), the
    autograd modes they ran in (`grad_mode`), and how many calls each of those methods' runs made (`first_calls`
    began one, `later_calls` followed within it: generate's steps); `later` holds, for the first
    CALIBRATION_BATCHES calls, whether each was a later one."""
    own_callers: set[str] = field(default_factory=set)
    grad_modes: set[str] = field(default_factory=set)
    first_calls: int = 0
    later_calls: int = 0
    later: list[bool] = field(default_factory=list)
    _run: FrameType | None = field(default=None, repr=False, compare=False)   # the run the last call was in

    def saw(self, module: nn.Module) -> None:
        callers = _own_callers(module)
        if callers:
            self.own_callers.add(callers[0].f_code.co_qualname)
        # A run is the outermost method of the module's on the stack (generate, whose _prefill makes the first call
        # and _sample the rest). A frame held here is not reused: the next run is another frame object.
        is_later = bool(callers) and callers[-1] is self._run
        self.first_calls, self.later_calls = self.first_calls + (not is_later), self.later_calls + is_later
        if len(self.later) < CALIBRATION_BATCHES:
            self.later.append(is_later)
        self._run = callers[-1] if callers else None
        self.grad_modes.add(grad_mode())

    def calls_to_time(self) -> list[LatencyInput]:
        """Where the model's own methods call it again and again (generate's steps after the prompt's call), the
        recorded calls that stand for both kinds: the first (call 0) and the first later one, weighted by how many
        of each eval_fn made; [] where every call began a run (the first recorded call stands for them all)."""
        if not self.later_calls or True not in self.later:
            return []
        return [LatencyInput(call=0), LatencyInput(call=self.later.index(True),
                                                   weight=round(self.later_calls / self.first_calls, 2))]


def grad_mode() -> str:
    """The autograd mode a call runs in now: "inference_mode", "no_grad" or "grad"."""
    if torch.is_inference_mode_enabled():
        return "inference_mode"
    return "grad" if torch.is_grad_enabled() else "no_grad"


def without_autograd(mode: str | None) -> contextlib.AbstractContextManager:
    """What the tuner's own calls of a model eval_fn will call run under: torch.no_grad where eval_fn's calls ran
    so, else torch.inference_mode. A compiled model's graphs are made per mode: ones made under inference_mode were
    made again in eval_fn's first no_grad call (minutes on a large model)."""
    return torch.no_grad() if mode == "no_grad" else torch.inference_mode()


def run_capturing(model: nn.Module, eval_fn: Callable[[nn.Module], Any], stop_early: bool,
                  batches: int = CALIBRATION_BATCHES, called: str = "eval_fn",
                  how: HowCalled | None = None, required: bool = True) -> tuple[Any, list[CallInputs]]:
    """Calls eval_fn(model) and records the first `batches` batches the model sees, and in `how`, where given,
    what every call was like.

    With stop_early, eval_fn is abandoned right after them (used when its result is already known).
    Returns (eval_fn's return value or None, the recorded inputs, first batch first); `called` names eval_fn in
    the error raised where the model was never called and inputs are `required` (none were given).
    """
    recorded: list[CallInputs] = []
    entries = _EntryCalls(model)

    def hook(module, args, kwargs):
        if how is not None:
            how.saw(module)
        if len(recorded) < batches:
            recorded.append(entries.before(args, kwargs))
            if len(recorded) == batches:
                entries.close()
        if stop_early and len(recorded) >= batches:
            raise _Captured

    children: dict[str, set[str]] = {}     # child called before the model was: the model's methods calling it

    def child_hook(module, args, name):
        if not recorded:
            callers = _callers_of(model)
            children.setdefault(name, set()).update(callers)
            if how is not None:    # CLIP's get_text_features: a compiled forward would not reach these calls
                how.own_callers.update(callers)

    handles = [model.register_forward_pre_hook(hook, with_kwargs=True),
               *(child.register_forward_pre_hook(functools.partial(child_hook, name=name))
                 for name, child in model.named_children() if not isinstance(child, torch.jit.ScriptModule))]
    result = None
    try:
        result = eval_fn(model)
    except _Captured:
        pass
    finally:
        entries.close()
        for handle in handles:
            handle.remove()
    if not recorded and required:
        raise EvalFunctionError(_never_called(called, children))
    return result, recorded


def _never_called(called: str, children: dict[str, set[str]]) -> str:
    if not children:
        return (f"{called} never called the model it was given, so no example inputs could be captured; call the "
                f"model inside {called} or pass example_inputs")
    methods = sorted(set().union(*children.values())) or ["code outside the model"]
    return (f"{called} never called the model's forward, only its submodules {', '.join(sorted(children))}, through "
            f"{', '.join(methods)}: the tuner times and calibrates the model as its forward runs, so pass "
            f"example_inputs for the forward (eval_fn keeps scoring through its methods), or tune the submodule "
            f"itself (autotune(model.{min(children)}, ...), {called} taking it)")


def _callers_of(model: nn.Module) -> list[str]:
    """The methods of `model` on the stack now, as "Class.method" (not the wrappers decorators put around them,
    transformers' `can_return_tuple.<locals>.wrapper`)."""
    names = (frame.f_code.co_qualname for frame in _methods_running(model, inspect.currentframe()))
    return [name for name in names if "<locals>" not in name]


def _methods_running(module: nn.Module, frame: FrameType | None) -> list[FrameType]:
    """The frames of methods of `module` from `frame` outwards, innermost first."""
    found = []
    while frame is not None:
        if frame.f_locals.get("self") is module:
            found.append(frame)
        frame = frame.f_back
    return found


def _caller() -> FrameType | None:
    """The frame calling the module whose hook runs now: past this file's functions, the hook, and nn.Module's
    call machinery."""
    frame = inspect.currentframe()
    while frame is not None and (frame.f_code.co_filename in (__file__, nn.Module.__call__.__code__.co_filename)):
        frame = frame.f_back
    return frame


def _own_callers(module: nn.Module) -> list[FrameType]:
    """The frames of the methods of `module` itself on the stack, innermost first, where one of them is calling it
    now (transformers' `generate` calls `self(...)` at each step); [] where code outside the module calls it.
    Called from a forward pre-hook."""
    frame = _caller()
    if frame is None or frame.f_locals.get("self") is not module:
        return []
    return _methods_running(module, frame)


class _EntryCalls:
    """The calls of `model`'s submodules made apart from its forward (generate running an encoder-decoder's encoder
    from a method of the model, or eval_fn's own decoding loop doing so), each with its inputs and its output's
    tensors, until the model's next call takes those made in the same run of its methods, or outside any (`before`):
    see autotune.model_call. Calls within the forward or within such a call are parts of them."""

    def __init__(self, model: nn.Module):
        self.model, self.within, self.run = model, 0, None
        self.pending: list[tuple[str, CallInputs, list[torch.Tensor]]] = []
        self.handles = [model.register_forward_pre_hook(self._entered),
                        model.register_forward_hook(self._left, always_call=True),
                        *(module.register_forward_pre_hook(functools.partial(self._called, path=path),
                                                           with_kwargs=True)
                          for path, module in model.named_modules()
                          if path and not isinstance(module, torch.jit.ScriptModule))]

    def _entered(self, *_):
        self.within += 1

    def _left(self, *_):
        self.within -= 1

    def _called(self, module, args, kwargs, path):
        if self.within:
            return
        methods = _methods_running(self.model, _caller())
        run = methods[-1] if methods else None
        if run is not self.run:
            self.pending, self.run = [], run
        entry = (path, (detach_clone(args), detach_clone(kwargs)), [])
        self.pending.append(entry)
        self.within += 1

        def done(module, args, output):
            self.within -= 1
            entry[2].extend(tensors(output))
            handle.remove()
        handle = module.register_forward_hook(done, always_call=True)

    def before(self, args: tuple, kwargs: dict) -> CallInputs:
        """The model's call on (args, kwargs), recorded: with the entries its run made since its last call."""
        callers = _own_callers(self.model)
        pending = self.pending if (callers[-1] if callers else None) is self.run else []
        self.pending = []
        recorded = (detach_clone(args), detach_clone(kwargs))
        if not pending:
            return recorded
        return ModelCall(recorded, [(path, inputs) for path, inputs, _ in pending],
                         linked((args, kwargs), [found for _, _, found in pending]))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def record_module_inputs(model: nn.Module, names: list[str], inputs: CallInputs) -> dict[str, CallInputs]:
    """One forward pass on `inputs`; returns what each named submodule was first called with."""
    recorded: dict[str, CallInputs] = {}
    _each_module_call(model, names, inputs,
                      lambda name, args, kwargs: recorded.setdefault(name, (detach_clone(args), detach_clone(kwargs))))
    return recorded


def module_calls(model: nn.Module, names: list[str], inputs: CallInputs) -> dict[str, int]:
    """One forward pass on `inputs`; returns how many times it called each named submodule (a cell stepped in a
    loop, a layer every block shares: one call's time is not the module's cost), 0 for one it never called."""
    counts = dict.fromkeys(names, 0)
    _each_module_call(model, names, inputs, lambda name, args, kwargs: counts.__setitem__(name, counts[name] + 1))
    return counts


def _each_module_call(model: nn.Module, names: list[str], inputs: CallInputs,
                      seen: Callable[[str, tuple, dict], Any]) -> None:
    """One forward of `model` on `inputs`, `seen(name, args, kwargs)` at each call of a named submodule."""
    handles = []
    for name in names:
        def hook(module, args, kwargs, name=name):
            seen(name, args, kwargs)
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    with children_called_as_modules(model, names):   # as they will be once lowered
        call_hooked(model, inputs, handles)


def call_hooked(model: nn.Module, inputs: CallInputs, handles: list) -> Any:
    """One forward of `model` on `inputs` (inference mode) with the hooks behind `handles`, removed after it."""
    try:
        with torch.inference_mode():
            return call(model, inputs)
    finally:
        for handle in handles:
            handle.remove()


def failure_of(model: nn.Module, inputs: CallInputs) -> str | None:
    """Why one call of `model` on `inputs` fails ("TypeName: message"), or None if it runs."""
    try:
        with torch.inference_mode():
            call(model, inputs)
    except Exception as exc:  # the user's model: any failure is the answer
        return describe(exc, 200)
    return None


def to_device(inputs: Any, device: torch.device) -> Any:
    return map_tensors(inputs, lambda t: t.to(device))


def with_fed_batches(example: list[CallInputs], fed: list[CallInputs]) -> list[CallInputs]:
    """The whole-model batches static int8 ranges are calibrated on where example_inputs are all that was given:
    `example` (those inputs), then the first of `fed` (the batches eval_fn fed the model) that call it alike, up to
    CALIBRATION_BATCHES in all, each copied per call where the first is (the model changes its inputs in place).

    Ranges taken on one batch clip what the next ones hold: a YOLOS in uniform int8, calibrated on its example
    alone, agreed with fp32 on 95 % of images where eval_fn's first four made it 98 %. A call passing other
    arguments, dtypes or numbers of dimensions (a generation's steps), another image size, or another size where
    the example's is 0 or 1 (export fixes those) is left out: the graph exported on the example would refuse it;
    so is the example itself, fed again (example_inputs taken as a loader's first batch).
    """
    alike = [batch for batch in fed if _called_alike(example[0], batch) and not _the_same(example[0], batch)]
    alike = alike[:CALIBRATION_BATCHES - len(example)]
    if getattr(example[0], "changes_inputs", False):
        alike = [ModelCall((args, kwargs), changes_inputs=True) for args, kwargs in alike]
    return [*example, *alike]


def eval_fn_batches(model: nn.Module, eval_fn: Callable[[nn.Module], Any]) -> list[CallInputs]:
    """The first batches eval_fn feeds `model`, eval_fn abandoned right after them (one call, cut short); none
    where it fails (said) or never calls the model's forward (with example_inputs it need not)."""
    try:
        return run_capturing(model, eval_fn, stop_early=True, required=False)[1]
    except Exception as exc:  # noqa: BLE001 - the user's function: static ranges then rest on the example alone
        log.warning("eval_fn failed as it was started for its first batches (%s): static int8 ranges are "
                    "calibrated on example_inputs alone", describe(exc))
        return []


def _called_alike(first: CallInputs, other: CallInputs) -> bool:
    if entries_of(other):
        return False
    ours, theirs = (first[0], first[1]), (other[0], other[1])
    try:
        if map_tensors(ours, lambda t: None) != map_tensors(theirs, lambda t: None):
            return False
    except Exception:  # noqa: BLE001 - an argument whose == raises or is no truth value (an array) differs
        return False
    return all(a.dtype == b.dtype and a.dim() == b.dim()
               and all(n == m for i, (n, m) in enumerate(zip(a.shape, b.shape)) if n <= 1 or (i and a.dim() >= 4))
               for a, b in zip(tensors(ours), tensors(theirs)))


def _the_same(first: CallInputs, other: CallInputs) -> bool:
    return all(same_values(a, b) for a, b in zip(tensors(first), tensors(other)))


def example_or_batches(model: nn.Module, eval_fn: Callable[[nn.Module], Any], example_inputs: Any,
                       device: torch.device, run_fn: Callable[[nn.Module], Any] | None = None) -> list[CallInputs]:
    """The batches the model is timed and calibrated on, on `device`: `example_inputs` first, then the first
    batches `run_fn` (a calibration function, as INC's `run_fn`) feeds `model`, up to CALIBRATION_BATCHES in all;
    with neither, the first batches eval_fn feeds it. run_fn and eval_fn are abandoned right after them.

    Raises:
        EvalFunctionError: run_fn fails, or the function called never calls the model.
    """
    # Copies: the user's own tensors are never handed to the tuner's calls (a forward may change them in place).
    batches = [] if example_inputs is None else [to_device(detach_clone(as_call_inputs(example_inputs)), device)]
    if run_fn is not None and len(batches) < CALIBRATION_BATCHES:
        try:
            batches += run_capturing(model, run_fn, stop_early=True, batches=CALIBRATION_BATCHES - len(batches),
                                     called="run_fn")[1]
        except EvalFunctionError:
            raise
        except Exception as exc:  # the user's function: any failure is theirs to see
            raise EvalFunctionError(f"run_fn failed on the fp32 model: {describe(exc)}") from exc
    return batches or run_capturing(model, eval_fn, stop_early=True)[1]
