"""eval_fn's scores: its return value read as a number, and the fp32 baseline score every trial is judged against.

The baseline is evaluated once per study, by whichever worker asks first under the study's "baseline" lease, and
stored on the study. The worker that measures the signals asks for it: first where its call also captures the
inputs the signals need (no example_inputs), else right after them, while the other workers start their first
trials and ask only when a trial needs judging; the baseline's eval_fn call then runs beside the first round of
trials instead of before it.
"""
from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import optuna
import torch
from optuna.storages import RDBStorage
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import HowCalled, run_capturing
from autotune.clone import clone
from autotune.config.tuning import TuningConfig
from autotune.errors import ConfigError, EvalFunctionError, StudyMismatchError
from autotune.measure.shapes import time_weighted
from autotune.storage import study as studies
from autotune.storage.claims import lease
from autotune.timeout import call_with_timeout

log = logging.getLogger("autotune")


def _described(value: Any) -> str:
    """What came back, in one short line: an array by its shape (reduce it to the score, e.g. `.mean().item()`)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}: reduce it to one number"
    return f"{type(value).__name__} {' '.join(repr(value).split())[:80]}"


def score_of(value: Any) -> float:
    """eval_fn's return as a finite float, or EvalFunctionError saying what came back instead. A tensor or numpy
    array of one element is its number."""
    one_element_array = type(value).__name__ == "ndarray" and value.size == 1    # numpy's, not imported here
    if (isinstance(value, torch.Tensor) and value.numel() == 1) or one_element_array:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EvalFunctionError(f"eval_fn must return a number; it returned {_described(value)}")
    if not math.isfinite(value):
        raise EvalFunctionError(f"eval_fn returned {value}, not a finite number")
    return float(value)


# Sums of one tensor's values may differ by rounding alone where they are reduced otherwise (an eval_fn that sets
# torch's thread count): a change smaller than this share of its values' absolute sum is none.
ROUNDING = 1e-9


def tensor_sums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, tuple[str, tuple[float, float] | None]]:
    """Each tensor by identity: its name, the sum of its values and of their absolute values (None where it cannot
    be summed, a lazy module's parameter before its first call). Identity, not names: a compiled model may register
    its modules again under new names as it runs (engines.frozen's step down), and its tensors stay the same."""
    sums = {}
    with torch.no_grad():
        for name, tensor in named:
            try:
                values = tensor if tensor.is_floating_point() else tensor.double()    # a call counter's int64
                total: tuple[float, float] | None = (values.sum(dtype=torch.float64).item(),
                                                     torch.linalg.vector_norm(values, 1, dtype=torch.float64).item())
            except Exception:  # any tensor subclass or uninitialised parameter: not compared
                total = None
            sums[id(tensor)] = (name, total)
    return sums


def _differ(before: tuple[float, float] | None, after: tuple[float, float] | None) -> bool:
    if before is None or after is None:
        return False
    if any(math.isnan(value) for value in (*before, *after)):
        return any(math.isnan(a) != math.isnan(b) for a, b in zip(before, after))
    scale = ROUNDING * max(before[1], after[1])
    return abs(before[0] - after[0]) > scale or abs(before[1] - after[1]) > scale


def changed(before: dict[int, tuple[str, tuple[float, float] | None]],
            after: dict[int, tuple[str, tuple[float, float] | None]]) -> tuple[list[str], list[str]]:
    """The names of the tensors of `before` (tensor_sums) gone from `after`, and of those whose values changed."""
    gone = [name for key, (name, _) in before.items() if key not in after]
    moved = [name for key, (name, sums) in before.items() if key in after and _differ(sums, after[key][1])]
    return gone, moved


def _left_unchanged(model: nn.Module, before: dict[int, tuple[str, tuple[float, float] | None]]) -> None:
    """Raises EvalFunctionError where eval_fn changed `model`'s parameters (`before`: their tensor_sums): what it
    scored is what is timed and handed back."""
    gone, moved = changed(before, tensor_sums(model.named_parameters()))
    if changes := [*(f"{name} is no longer in it" for name in gone), *(f"{name}'s values changed" for name in moved)]:
        said = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
        raise EvalFunctionError(f"eval_fn changed the model it was given ({said}): the model it scores is the one "
                                "timed and handed back, so it must leave it as it found it (change a copy, "
                                "copy.deepcopy(model), where it needs to)")


def scored(eval_fn: Callable[[nn.Module], Any], model: nn.Module, seconds: float | None) -> float:
    """eval_fn's score of `model` (score_of), within `seconds`. Raises EvalFunctionError where eval_fn changed the
    model's parameters: an eval_fn scaling every weight after scoring had a model scoring 0.853 handed back as
    0.9435, and one replacing a Linear made the winner's timing crash."""
    before = tensor_sums(model.named_parameters())
    score = score_of(call_with_timeout(eval_fn, model, seconds))
    _left_unchanged(model, before)
    return score


class HandedState:
    """The buffers a model's own forward moves in eval mode (an EMA of its inputs, a call counter), as the model was
    handed over. Every call the tuner makes moves them, its timing's included: plans were scored from the states
    earlier calls left, good ones rejected ("lost at least 0.062" where they lost 0.0001). They are put back
    before each eval_fn call (`scoring`) and in the model handed back. By name: a module a plan replaced, or a
    compiled graph, may hold them under other names, and then keeps its own."""

    def __init__(self, fp32: nn.Module):
        self.values = {name: buffer.detach().clone() for name, buffer in fp32.named_buffers()}

    def keep_only(self, names: Iterable[str]) -> None:
        self.values = {name: self.values[name] for name in names if name in self.values}

    def put_back(self, model: nn.Module) -> None:
        with torch.no_grad():
            for name, value in self.values.items():
                try:
                    buffer = model.get_buffer(name)
                except AttributeError:
                    continue
                if buffer.shape == value.shape:
                    buffer.copy_(value)

    def scoring(self, eval_fn: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
        def from_the_handed_state(model: nn.Module) -> Any:
            self.put_back(model)
            return eval_fn(model)
        return from_the_handed_state


@contextmanager
def failing_as_the_baseline() -> Iterator[None]:
    """Reports any failure of eval_fn on the fp32 model (its inputs' capture included) as the baseline's."""
    try:
        yield
    except EvalFunctionError as exc:
        raise EvalFunctionError(f"the fp32 baseline evaluation failed, so no trial was run: {exc}") from exc
    except Exception as exc:  # the user's code: any failure
        raise EvalFunctionError(f"the fp32 baseline evaluation failed, so no trial was run: "
                                f"{type(exc).__name__}: {exc}") from exc


def evaluate_baseline(fp32: nn.Module, eval_fn: Callable[[nn.Module], Any], config: TuningConfig,
                      how: HowCalled | None = None, captures_inputs: bool = True) -> tuple[float, list[CallInputs]]:
    """eval_fn's score of a copy of the fp32 model, checked usable as the base of the configured loss, and the
    first batches eval_fn fed it; what its calls were like goes to `how`, where given. Without `captures_inputs`
    (example_inputs are what the tuner runs the model on), eval_fn need not call the model's forward itself."""
    with failing_as_the_baseline():
        model = clone(fp32)
        before = tensor_sums(model.named_parameters())
        returned, batches = run_capturing(model, eval_fn, stop_early=False, how=how, required=captures_inputs)
        baseline = score_of(returned)
        _left_unchanged(model, before)
    if config.loss_kind == "relative" and baseline == 0:
        # A loss relative to a baseline of 0 is infinite for any drop: every plan would fail for that alone.
        raise ConfigError("loss_kind: the fp32 model scored exactly 0, so a loss relative to it is infinite for any "
                          "drop; set loss_kind: absolute (tolerable_loss is then in eval_fn's units)",
                          [("loss_kind", "relative to a baseline of 0")])
    return baseline, batches


# The model's own methods that eval_fn reached it through (transformers' generate): they call the module itself, so
# a compiled wrapper handed to eval_fn runs none of its compiled code there (autotune.search.finalists).
OWN_CALLERS_ATTR = "model_called_by_its_methods"
GRAD_MODE_ATTR = "eval_grad_mode"   # the autograd mode of eval_fn's calls of the model (capture.grad_mode)
# The submodules called apart from the forward before a call of the model (generate's, or eval_fn's own decoding
# loop's encoder, model_call.entry_paths): eval_fn calls them on the model it is given, so they are compiled in place.
ENTRY_CALLS_ATTR = "entry_calls"
# The latency_inputs the study times at where the config names none: the recorded calls standing for a generation's
# first call and its steps, weighted by their share of eval_fn's time (_choose_timed_calls).
TIMED_CALLS_ATTR = "timed_calls"


def compiled_in_place(study: optuna.Study) -> bool:
    """Whether eval_fn reaches the model otherwise than by calling it (its own methods, or its submodules called
    apart), so that a compiling engine compiles it in place (engines.CALLS_ITSELF) rather than wrap it."""
    return bool(studies.get_attr(study, OWN_CALLERS_ATTR) or studies.get_attr(study, ENTRY_CALLS_ATTR))


def rescored(study: optuna.Study, fp32: nn.Module, eval_fn: Callable[[nn.Module], Any], config: TuningConfig,
             captures_inputs: bool) -> tuple[float, list[CallInputs]]:
    """The fp32 model's score on eval_fn's data now (the recorded one where they agree), one eval_fn call, and
    the first batches it fed the model: what a process joining a study whose baseline another scored judges
    against. The study is named after the model and config, not the data eval_fn scores on: resumed on other data,
    its new plans were judged against the old score, failed for good, and the recorded best was overwritten by fp32.

    Raises:
        StudyMismatchError: the score is more than the tolerance away from the recorded one.
    """
    score, batches = evaluate_baseline(fp32, eval_fn, config, captures_inputs=captures_inputs)
    recorded = studies.get_attr(study, studies.BASELINE_ATTR)
    if math.isclose(score, recorded, rel_tol=1e-6, abs_tol=1e-12):   # a sum's last digits, summed otherwise
        return recorded, batches
    said = (f"eval_fn scores the fp32 model {score:.6g} where study {study.study_name!r} recorded {recorded:.6g} "
            "when it was tuned")
    if abs(config.accuracy_loss(recorded, score)) > config.tolerable_loss:
        raise StudyMismatchError(f"{said}: its data or metric changed since, and its plans were judged against "
                                 "the old scores; tune it under another study_name (or `autotune delete` the study)")
    log.warning("%s, within the tolerance: this process judges plans against the score now (and scores a recorded "
                "best again)", said)
    return score, batches


def study_baseline(study: optuna.Study, storage: RDBStorage, fp32: nn.Module, eval_fn: Callable[[nn.Module], Any],
                   config: TuningConfig, captures_inputs: bool = False) -> tuple[float, list[CallInputs] | None]:
    """The study's baseline score, and where this worker evaluated it (one eval_fn call), the first batches that
    call fed the model; None where it was stored. Waits while another worker evaluates it. A failure is not
    stored: the next worker to ask tries again. `captures_inputs`: those batches are the inputs the tuner runs the
    model on (none were given), so eval_fn must call the model, and the calls to time are chosen among them."""
    stored = studies.get_attr(study, studies.BASELINE_ATTR)
    if stored is not None:
        return stored, None
    with lease(storage, study.study_name, "baseline", ttl_s=config.grace_period):
        stored = studies.get_attr(study, studies.BASELINE_ATTR)
        if stored is not None:
            return stored, None
        how, started = HowCalled(), time.perf_counter()
        baseline, batches = evaluate_baseline(fp32, eval_fn, config, how, captures_inputs)
        studies.set_attr(study, studies.BASELINE_EVAL_S_ATTR, round(time.perf_counter() - started, 3))
        studies.set_attr(study, OWN_CALLERS_ATTR, sorted(how.own_callers))
        if not config.latency_inputs:
            _choose_timed_calls(study, config, how, fp32, batches if captures_inputs else None)
        studies.set_attr(study, GRAD_MODE_ATTR, how.grad_modes.pop() if len(how.grad_modes) == 1 else "mixed")
        studies.set_attr(study, studies.BASELINE_ATTR, baseline)
    log.info("baseline score %.6g", baseline)
    return baseline, batches


def _choose_timed_calls(study: optuna.Study, config: TuningConfig, how: HowCalled, fp32: nn.Module,
                        recorded: list[CallInputs] | None) -> None:
    """Where the model's own methods call it again and again (a generation: the prompt's call, then a step per
    position), records the `recorded` calls standing for each kind, weighted by their share of eval_fn's time
    (shapes.time_weighted). Without `recorded` (example_inputs are what latency is measured on), says how to name
    them."""
    calls = how.calls_to_time() if recorded is not None else []
    chosen = time_weighted(calls, recorded, fp32, config.num_threads) if calls else None
    if chosen is not None:
        (first, later), share = chosen
        studies.set_attr(study, TIMED_CALLS_ATTR, [call.model_dump(exclude_defaults=True) for call in (first, later)])
        log.info("eval_fn calls the model through its own methods (%s), %g more times after each first call, each "
                 "at %.3f of its fp32 time: latency is measured at the first call and the next, weighted 1 : %g",
                 ", ".join(sorted(how.own_callers)), calls[1].weight, share, later.weight)
    elif how.later_calls and not calls:   # a generation timed at example_inputs alone
        log.warning("eval_fn calls the model through its own methods (%s), and only its first call is timed: "
                    "to time the calls after it too (generate's steps), set latency_inputs: [{call: 0}, {call: 1, "
                    "weight: W}], W = the steps per first call x a step's time / the first call's, or give no "
                    "example_inputs: the tuner then chooses and weighs them", ", ".join(sorted(how.own_callers)))
