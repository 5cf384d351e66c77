"""`autotune(model, tune_config, eval_fn)`: baseline, cheap signals, guided search, sampler, verified winner.

`start_runner`, `search` and `finish` are its three stages; the CLI's worker processes run the first two.
"""
from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any

import torch
from optuna.storages import BaseStorage, RDBStorage
from torch import nn

from autotune.backends import CallInputs, calibration_kept, held_dtype
from autotune.capture import detach_clone, example_or_batches, record_module_inputs
from autotune.clone import clone
from autotune.config.tuning import LatencyInput, TuningConfig
from autotune.discovery import (
    called_candidates,
    module_groups,
    runnable_alone,
    search_candidates,
    uncompiled,
    unlowerable,
    untuned_weights,
)
from autotune.engines import COMPILE_STATIC
from autotune.engines.knobs import BATCH_NORMS
from autotune.engines.quiet import library_notes_dropped
from autotune.errors import ConfigError, EvalFunctionError, NoTunableModulesError, describe, listed
from autotune.measure.allocator import allocation_while_timing
from autotune.measure.latency import device_name
from autotune.measure.measurer import DeviceMeasurer, Measurer, cached_signals
from autotune.measure.shapes import Shape, latency_shapes
from autotune.measure.size import weight_bytes
from autotune.model_call import copied_per_call, entry_paths
from autotune.plan import module_shapes
from autotune.result import BUSY_KEY, CONTENDED, NOISE_KEY, Measurement, ShapeLatency, TuningResult, counted
from autotune.search.driver import TIMEOUT_REACHED, run_search
from autotune.search.scores import (
    ENTRY_CALLS_ATTR,
    TIMED_CALLS_ATTR,
    HandedState,
    changed,
    failing_as_the_baseline,
    rescored,
    study_baseline,
    tensor_sums,
)
from autotune.search.space import SearchSpace
from autotune.search.trials import EvalFn, TrialCallback, TrialRunner, fail_stale_trials
from autotune.search.winner import verified_winner
from autotune.storage import study as studies
from autotune.storage.claims import PlanClaims, lease
from autotune.storage.rdb import open_storage

log = logging.getLogger("autotune")

# Of a run's `timeout`, what the search may spend where a compiling engine is configured; the rest is the finalists'
# compiles. A search spending all of it left no engine compiled: a KAN returned eager int8 at 0.75x where
# torch.compile ran it 3x faster or more, a DINOv2 1.30x where torch.compile gave 1.80x.
SEARCH_SHARE = 0.75


def study_name_for(model: nn.Module, config: TuningConfig, candidates: dict[str, list[str]] | None = None,
                   storage: BaseStorage | None = None, weights: dict[str, list[float]] | None = None) -> str:
    """The configured study name, or the one derived from the model class and search space (in `storage`, the one
    of those that holds the model's weights: studies.study_name_for_weights)."""
    if config.study_name:
        return config.study_name
    model = uncompiled(model)
    name = studies.default_study_name(
        type(model).__name__, candidates if candidates is not None else search_candidates(model, config), config)
    if storage is None:
        return name
    return studies.study_name_for_weights(storage, name, studies.weights_signature(model) if weights is None
                                          else weights)


def run_settings(config: TuningConfig, device: torch.device, allocation: str) -> dict[str, Any]:
    """Where and how the study's latencies are measured, and its tolerance: what the report shows beside them."""
    return {"device": str(device), "device_name": device_name(device),
            "num_threads": config.num_threads or torch.get_num_threads(), "allocation": allocation,
            "warmup": config.warmup,
            "repeats": config.repeats, "torch": torch.__version__, "tolerable_loss": config.tolerable_loss,
            "loss_kind": config.loss_kind, "higher_is_better": config.higher_is_better, "objective": config.objective,
            "heartbeat_interval": config.heartbeat_interval, "grace_period": config.grace_period}


@contextmanager
def _fewer_collections(allocations: int = 20_000) -> Iterator[None]:
    """Lets the cyclic garbage collector wait for more allocations while the tuner runs (restored after).

    A trial allocates a few hundred thousand short-lived objects (its model's modules, Optuna's trial records),
    nearly all freed by reference counting; at Python's default threshold (700) the collector would scan the
    long-lived model and study over a thousand times in a search of a big model.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], allocations), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def autotune(model: nn.Module, tune_config: TuningConfig | dict, eval_fn: EvalFn, example_inputs: Any = None, *,
             eval_args: Sequence[Any] | None = None, run_fn: Callable[..., Any] | None = None,
             run_args: Sequence[Any] | None = None, measurer: Measurer | None = None,
             callbacks: Sequence[TrialCallback] = ()) -> TuningResult:
    """Finds the fastest per-module dtype plan whose eval_fn score stays within the tolerable loss.

    Args:
        model: the fp32 model; it is never modified (every candidate is built on a private copy).
        tune_config: a TuningConfig, or a mapping of its fields.
        eval_fn: `eval_fn(model, *eval_args) -> number` scores a model (higher is better unless the config says
            otherwise).
        example_inputs: inputs for latency measurement and calibration (static int8 ranges, without run_fn, also
            on eval_fn's first batches that call the model alike); by default the first batches run_fn, or else
            eval_fn, gives the model are captured.
        eval_args: what eval_fn takes after the model, as INC's `eval_args`.
        run_fn: `run_fn(model, *run_args)` feeds the model calibration data, as INC's `run_fn`: static int8 is
            calibrated on its first batches (after example_inputs), and without example_inputs the model is timed
            on the first.
        run_args: what run_fn takes after the model.
        measurer: replaces on-device measurement (signals and latency), e.g. with a simulator.
        callbacks: Optuna callbacks, called with (study, finished trial) after every trial this process runs.
    Returns:
        The tuned model, its plan, the baseline and tuned measurements, and the study.
    Raises:
        ConfigError: the configuration is invalid for this model.
        EvalFunctionError: eval_fn or run_fn is not callable, eval_args or run_args is not a tuple, run_fn failed,
            or the fp32 baseline evaluation failed.
        StudyMismatchError: the named study exists for another model or search space.
    """
    started = time.monotonic()
    runner = start_runner(model, tune_config, eval_fn, example_inputs, measurer, callbacks, eval_args=eval_args,
                          run_fn=run_fn, run_args=run_args)
    stopped = search(runner, started)
    return finish(runner, started, stopped)


@_fewer_collections()
def start_runner(model: nn.Module, tune_config: TuningConfig | dict, eval_fn: EvalFn, example_inputs: Any = None,
                 measurer: Measurer | None = None, callbacks: Sequence[TrialCallback] = (), *,
                 eval_args: Sequence[Any] | None = None, run_fn: Callable[..., Any] | None = None,
                 run_args: Sequence[Any] | None = None, storage: RDBStorage | None = None) -> TrialRunner:
    """Opens (or joins) the study and makes it ready for trials: signals, search space, baseline score. `storage`,
    where given, is used instead of opening `tune_config.storage` (a service's worker opens its own).

    Several processes may do this on one study at once: the first measures the signals under the study's setup
    lease and then evaluates the baseline; the others reuse the signals and start trials at once, judging them
    once the baseline is stored (autotune.search.scores). Arguments and errors as for `autotune`.
    """
    config = tune_config if isinstance(tune_config, TuningConfig) else TuningConfig.from_mapping(tune_config)
    if not isinstance(model, nn.Module):
        raise NoTunableModulesError(f"autotune tunes a torch.nn.Module; got {type(model).__name__}"
                                    + (" (a state_dict: load it into its model first)" if isinstance(model, dict)
                                       else ""))
    eval_fn = _taking_the_model_alone(eval_fn, eval_args, "eval_fn")
    run_fn = None if run_fn is None else _taking_the_model_alone(run_fn, run_args, "run_fn")
    if run_fn is None and run_args is not None:
        raise EvalFunctionError("run_args were given without run_fn, the function they are passed to")
    device = usable_device(torch.device(config.device))
    if (inner := uncompiled(model)) is not model:
        log.info("the model holds torch.compile wrappers: the modules they compile are tuned (module names without "
                 "their _orig_mod), and the compiling engines compile the finalists")
        model = inner
    fp32 = _working_copy(model, device)
    candidates = search_candidates(fp32, config)
    untuned_weights(fp32, candidates)
    unlowerable(fp32, candidates)
    storage = storage or open_storage(config.storage, config.heartbeat_interval, config.grace_period)
    weights = studies.weights_signature(fp32)
    name = study_name_for(model, config, candidates, storage, weights)
    study = studies.open_study(config, name, candidates, storage, weights)
    _record_settings(study, config, device, fp32)
    studies.set_attr(study, studies.MODULE_SHAPES_ATTR, module_shapes(fp32, candidates))
    measurer = measurer or DeviceMeasurer(config)
    fail_stale_trials(study, config.grace_period)   # a killed earlier run's trials: FAILED, their plans queued

    setup = _set_up_in_turn(study, storage, fp32, eval_fn, example_inputs, run_fn, candidates, config, measurer)
    candidates = setup.candidates
    space = SearchSpace.build(candidates, setup.sensitivity, setup.latency, module_groups(candidates, config, fp32))
    log.info("%d tunable modules in %d units; %s combinations after pruning", len(candidates), len(space.choices),
             f"{space.size:,}" if space.size < 10 ** 15 else f"about 10^{len(str(space.size)) - 1}")
    if setup.handed_state is not None:
        eval_fn = setup.handed_state.scoring(eval_fn)
    runner = TrialRunner(study, PlanClaims(storage, name), space, fp32, eval_fn, setup.batches[0], setup.calibration,
                         config, measurer, callbacks, setup.batches, setup.shapes)
    runner.eval_calls, runner.handed_state = setup.eval_calls, setup.handed_state
    runner.example_alone = example_inputs is not None and run_fn is None
    runner.fed(setup.fed)
    if setup.rescored is not None:
        runner.resumed_at(setup.rescored)
    if setup.measured_here:
        # Evaluated now (unless stored already), while the other workers run the first trials: they only wait
        # for it to judge them.
        runner.baseline  # noqa: B018
    return runner


def _record_settings(study, config: TuningConfig, device: torch.device, fp32: nn.Module) -> None:
    """Sets how latency is timed in this process, and records it on the study with what the views read: the
    dtype the model was handed over in, and the config's latency_inputs (for export; bench times them)."""
    allocation = allocation_while_timing(config.steady_allocation)
    log.info("%s", allocation)
    settings, earlier = run_settings(config, device, allocation), studies.get_attr(study, "settings") or {}
    before = [*earlier.get("num_threads_earlier", []), *([earlier["num_threads"]] if "num_threads" in earlier else [])]
    if other_counts := sorted({threads for threads in before if threads != settings["num_threads"]}):
        # Its signals and trials' ratios were timed at those: int8's and bf16's gain over fp32 differ with threads.
        log.warning("study %r holds timings taken on %s; this run times on %s, and its latency ratios are compared "
                    "with those (num_threads: %s keeps them alike)", study.study_name,
                    " and ".join(counted(threads, "thread") for threads in other_counts),
                    counted(settings["num_threads"], "thread"), other_counts[-1])
        settings["num_threads_earlier"] = other_counts
    studies.set_attr(study, "settings", settings)
    studies.set_attr(study, studies.HELD_DTYPE_ATTR, held_dtype(fp32))
    if config.latency_inputs and not any(callable(entry.factory) for entry in config.latency_inputs):
        studies.set_attr(study, studies.LATENCY_INPUTS_ATTR,
                         [entry.model_dump(exclude_defaults=True) for entry in config.latency_inputs])


def _taking_the_model_alone(fn: Any, args: Sequence[Any] | None, name: str) -> Callable[[nn.Module], Any]:
    """`fn(model, *args)` as a function of the model alone, which leaves the model in eval mode: INC's eval_fn /
    eval_args and run_fn / run_args (`name`: "eval_fn" or "run_fn").

    Raises:
        EvalFunctionError: fn is not callable, or args is not a tuple or list (one DataLoader given bare would be
            unpacked into its batches).
    """
    args_name = name.replace("_fn", "_args")
    if not callable(fn):
        raise EvalFunctionError(f"{name} must be callable as {name}(model{f', *{args_name}' if args else ''})"
                                f"{' -> number' if name == 'eval_fn' else ''}; got {type(fn).__name__}")
    if args is not None and not isinstance(args, (tuple, list)):
        raise EvalFunctionError(f"{args_name} must be a tuple of what {name} takes after the model; got "
                                f"{type(args).__name__}; one argument goes in a tuple of one: {args_name}=(value,)")

    def called(model: nn.Module) -> Any:
        try:
            return fn(model, *(args or ()))
        except TypeError as exc:
            if args is not None or exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                raise      # raised inside fn, not by calling it
            # INC's autotune takes eval_args fourth, where example_inputs are here: fn(model) missed its arguments.
            raise EvalFunctionError(f"{name} cannot be called with the model alone ({exc}): what it takes after the "
                                    f"model goes in {args_name}=(...), by keyword (INC's fourth argument; here the "
                                    "fourth is example_inputs)") from exc
        finally:   # a training loop's evaluate() ends with model.train(): the model timed and returned stays in eval
            with suppress(NotImplementedError):   # torch.export's modules refuse train() and eval()
                model.eval()
    return called


@dataclass
class _Setup:
    eval_calls: int
    batches: list[CallInputs]           # the first is where calibration and signals are taken
    candidates: dict[str, list[str]]    # those the forward calls (the others have no inputs to tune them on), in
                                        # the dtypes that keep its output (measurer.cached_signals)
    calibration: dict[str, CallInputs]
    shapes: list[Shape]
    sensitivity: dict[str, dict[str, float]]
    latency: dict[str, dict[str, float]]
    handed_state: HandedState | None    # where the forward moves its buffers
    measured_here: bool = False         # this process measured the study's signals
    rescored: float | None = None       # the fp32 model's score as this process joined the study
    fed: list[CallInputs] | None = None  # the first batches eval_fn fed the fp32 model as it was rescored


def usable_device(device: torch.device) -> torch.device:
    """`device`, where this process can run on it; else a ConfigError saying why (torch's own was an
    AssertionError from deep in Module.to: "Torch not compiled with CUDA enabled")."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":     # mps, xpu, ...: Module.to raised "PyTorch is not linked with support for mps"
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type == device.type:
            return device
        why = f"this torch has no {device.type} device here" + (
            f" (its accelerator: {accelerator.type})" if accelerator is not None else " (a CPU build, or none visible)")
    elif not torch.cuda.is_available():
        why = ("this torch was built without CUDA (a CPU wheel): install a CUDA build of torch, or tune on the CPU"
               if torch.version.cuda is None else "no CUDA GPU is visible to this process (drivers, "
               "CUDA_VISIBLE_DEVICES, or docker run without --gpus)")
    elif device.index is not None and device.index >= torch.cuda.device_count():
        why = f"this process sees {torch.cuda.device_count()} CUDA GPU(s), numbered from 0"
    else:
        return device
    message = f"device {str(device)!r} cannot be used here: {why}"
    raise ConfigError(message, [("tuning.device", message)])


DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _working_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """The copy of the user's model that the tuner calls, lowers and returns: in eval mode, since inference is what
    is tuned and timed (a model handed over in training mode is said to be), on `device`. Raises ConfigError where
    the model's weights were never loaded (the meta device)."""
    if any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers())):
        message = ("the model's weights are on the meta device, never loaded: load them first (e.g. "
                   "model.load_state_dict(state, assign=True), or from_pretrained without device_map='meta')")
        raise ConfigError(message, [("model", message)])
    # The model itself, or a module whose training mode changes what it computes: a quantize_dynamic Linear is
    # left in training mode on a model in eval mode, and computes alike in both.
    if model.training or any(module.training and isinstance(module, (DROPOUTS, BATCH_NORMS))
                             for module in model.modules()):
        log.warning("the model is in training mode%s: it is evaluated, tuned and returned in eval mode; call "
                    "model.eval() on yours to compare", _what_training_changes(model))
    fp32 = clone(model).eval()
    if any(tensor.device != device for tensor in itertools.chain(fp32.parameters(), fp32.buffers())):
        # Only then: `.to` reads every parameter's .grad, which warns on a torch.jit.script submodule's copy.
        fp32 = fp32.to(device)
    return fp32


def _what_training_changes(model: nn.Module) -> str:
    """" (dropout on, batch norm updating its statistics)", naming only what the model holds."""
    kinds = [(DROPOUTS, "dropout on"), (BATCH_NORMS, "batch norm updating its statistics")]
    held = [words for kind, words in kinds if any(isinstance(m, kind) for m in model.modules())]
    return f" ({', '.join(held)})" if held else ""


def _measured(study) -> bool:
    """Whether the study has its signals (a worker before this one measured them)."""
    return all(studies.get_attr(study, name) is not None for name in ("sensitivity", "module_latency_ms"))


def _set_up_in_turn(study, storage: RDBStorage, fp32: nn.Module, eval_fn: EvalFn, example_inputs: Any,
                    run_fn: Callable[[nn.Module], Any] | None, candidates: dict[str, list[str]], config: TuningConfig,
                    measurer: Measurer) -> _Setup:
    """_set_up: the first worker measures the signals under the study's setup lease; the others wait for it only,
    then set up from what it stored."""
    with lease(storage, study.study_name, "setup", ttl_s=config.grace_period):
        if not _measured(study):
            return replace(_set_up(study, storage, fp32, eval_fn, example_inputs, run_fn, candidates, config,
                                   measurer, first=True), measured_here=True)
    return _set_up(study, storage, fp32, eval_fn, example_inputs, run_fn, candidates, config, measurer)


def _set_up(study, storage: RDBStorage, fp32: nn.Module, eval_fn: EvalFn, example_inputs: Any,
            run_fn: Callable[[nn.Module], Any] | None, candidates: dict[str, list[str]], config: TuningConfig,
            measurer: Measurer, first: bool = False) -> _Setup:
    """The inputs, and the per-module signals: measured and stored if the study lacks them (`first`). Where the
    study's baseline was scored before, by another process, the fp32 model is scored again (scores.rescored)."""
    batches, eval_calls, device, score, captured = None, 0, torch.device(config.device), None, None
    given, evaluated_here = example_inputs is not None or run_fn is not None, False
    if given:
        batches = example_or_batches(fp32, eval_fn, example_inputs, device, run_fn)
    elif first:
        # The baseline's call captures the inputs too, so it comes first here (none stored it before).
        _, batches = study_baseline(study, storage, fp32, eval_fn, config, captures_inputs=True)
        evaluated_here = batches is not None
        eval_calls += evaluated_here
    if not evaluated_here and studies.get_attr(study, studies.BASELINE_ATTR) is not None:
        eval_calls += 1    # scored by another process, or an earlier run: its data may differ from eval_fn's now
        score, captured = rescored(study, fp32, eval_fn, config, captures_inputs=not given)
        batches = batches or captured
    if batches is None:
        # eval_fn is started for its first batches and abandoned: one call, cut short.
        eval_calls += 1
        with failing_as_the_baseline():
            batches = example_or_batches(fp32, eval_fn, None, device)
    probe = detach_clone(batches[0])    # the first call on it shows whether the model changes its inputs
    buffers, handed = tensor_sums(fp32.named_buffers()), HandedState(fp32)    # ... or its own state
    calibration = _first_call(fp32, candidates, probe, example_inputs is not None)
    if moved := changed(buffers, tensor_sums(fp32.named_buffers()))[1]:
        log.warning(STATEFUL, listed(moved))
        handed.keep_only(moved)
        handed.put_back(fp32)
    if (marked := copied_per_call(batches, probe)) is not batches:
        log.info("the model changes the tensors it is called with in place: each call the tuner makes gets copies")
        batches = marked
    studies.set_attr(study, ENTRY_CALLS_ATTR, list(entry_paths(batches)))
    candidates = runnable_alone(fp32, called_candidates(fp32, candidates, set(calibration)), calibration)
    timed_calls = None if given else studies.get_attr(study, TIMED_CALLS_ATTR)
    shapes = latency_shapes(config, batches, device, fp32,
                            [LatencyInput.model_validate(call) for call in timed_calls or []])
    studies.check_shapes(study, config, {shape.name: shape.weight for shape in shapes})
    sensitivity, latency = cached_signals(study, measurer, fp32, candidates, batches[0], calibration, shapes)
    unknown = sorted(set(candidates) - set(latency))
    if unknown:   # eval_fn reaches modules now that it did not when the study measured its signals
        log.warning("%d module(s) the study has no signals for stay as they are (%s): its signals were measured "
                    "when eval_fn did not call them; tune them in a new study", len(unknown), ", ".join(unknown))
    candidates = {name: [d for d in dtypes if d in latency[name]] for name, dtypes in candidates.items()
                  if name in latency}
    # From here on a module's recorded inputs only calibrate its lowering: kept whole for the whole run, a
    # 12-layer encoder's held as many bytes as its weights.
    calibration = {name: calibration_kept(fp32.get_submodule(name), candidates.get(name, []), inputs)
                   for name, inputs in calibration.items()}
    return _Setup(eval_calls, batches, candidates, calibration, shapes, sensitivity, latency,
                  handed if moved else None, rescored=score, fed=captured)


# A forward updating buffers in eval mode (an EMA of its inputs, a call counter): the tuner's own calls move them.
STATEFUL = ("the model's forward changes its buffers (%s): every call the tuner makes, its timing's included, moves "
            "them; they are put back as the model was handed over before each eval_fn call and in the model handed "
            "back (by name: a compiled finalist holding them otherwise keeps its own)")


def _first_call(fp32: nn.Module, candidates: dict[str, list[str]], probe: CallInputs, given: bool
                ) -> dict[str, CallInputs]:
    """What each candidate is first called with, on the first batch. Raises ConfigError where that batch is the
    `example_inputs` given (every other was the model's own call) and the model fails on it."""
    try:
        return record_module_inputs(fp32, list(candidates), probe)
    except Exception as exc:   # the user's model, on the user's inputs
        if not given:
            raise
        message = (f"the model fails on example_inputs: {describe(exc)}; they are passed as model(*a_tuple), "
                   "model(**a_dict) or model(a_tensor) (INC's eval_args, the fourth argument there, goes by keyword "
                   "here: eval_args=...)")
        raise ConfigError(message, [("example_inputs", message)]) from exc


@_fewer_collections()
def search(runner: TrialRunner, started: float, should_stop: Callable[[], str | None] | None = None) -> str:
    """Runs trials until the budget (max_trials, timeout, patience) is spent, all processes sharing it, or
    `should_stop` gives a reason. Returns why the search stopped."""
    timeout = runner.config.timeout
    if timeout is not None and runner.baseline is not None:   # with a timeout, the baseline first (else evaluated
        runner.refresh()      # in the first trial, alongside): its eval_fn call says how long a trial takes
    setup_s, share = time.monotonic() - started, 1.0 if set(runner.config.engines) == {"eager"} else SEARCH_SHARE
    if timeout is not None and setup_s + runner.trial_s >= share * timeout:   # the set-up is not cut short
        log.warning("the search's part of the run's timeout (%g of %g s) %s: the baseline and the per-module timings "
                    "took %.0f s, and a trial takes about %.0f s, so this run tries no plan; a longer timeout lets it",
                    share * timeout, timeout, "passed before it began" if setup_s >= share * timeout else
                    "leaves no time for a trial", setup_s, runner.trial_s)
    reason = run_search(runner, runner.config, started + share * (timeout or math.inf), should_stop)
    if reason == TIMEOUT_REACHED and share < 1.0:
        reason = f"its part of the timeout reached ({share * timeout:g} of {timeout:g} s; the rest is the finalists')"
    log.info("search stopped: %s", reason)
    runner.run_the_rest(should_stop)   # plans re-queued after a crash are retried even when the budget is spent
    return reason


@_fewer_collections()
def finish(runner: TrialRunner, started: float, stopped: str | None = None,
           still_ours: Callable[[], bool] | None = None) -> TuningResult:
    """The verified winner of the study, recorded on it as `best` unless `still_ours` says, once it is verified,
    that another process finished the study meanwhile (a service worker whose job another finished); `stopped`,
    why the search stopped, for its summary."""
    with library_notes_dropped():   # finalists are built, compiled and saved there
        winner = verified_winner(runner, started + runner.config.timeout if runner.config.timeout else None)
    if runner.handed_state is not None:    # its timing moved them
        runner.handed_state.put_back(winner.model)
    study, first = runner.study, winner.by_shape[runner.shapes[0].name]
    shapes = [ShapeLatency(shape.name, shape.weight, winner.by_shape[shape.name]["fp32"],
                           winner.by_shape[shape.name]["best"]) for shape in runner.shapes]
    result = TuningResult(
        model=winner.model, plan=winner.plan, study=study,
        baseline=Measurement(runner.baseline, first["fp32"], weight_bytes(runner.fp32)),
        best=Measurement(winner.accuracy, first["best"], weight_bytes(winner.model)),
        eval_calls=runner.eval_calls, trials_evaluated=len(studies.evaluated_trials(study)),
        wall_time_s=time.monotonic() - started, engine=winner.engine, shapes=shapes, knobs=winner.knobs,
        held=runner.kept, stopped=stopped, failed=studies.failures_said(study), built=winner.built,
        example=runner.batches[0])
    noisy, recorded_with = result.noisy_shapes(), studies.recorded_with(result.trials_evaluated, runner.config)
    busy = result.contended_shapes()
    if not winner.recorded and (still_ours is None or still_ours()):   # a recorded best keeps its figures
        studies.set_attr(study, "best", {"plan": winner.plan, "accuracy": winner.accuracy, "engine": winner.engine,
                                         "speedup": 1.0 / winner.ratio, "setup_s": round(winner.setup_s, 3),
                                         "knobs": list(winner.knobs), "finalist": winner.name,
                                         **({"compile_static": True} if getattr(winner.model, COMPILE_STATIC, False)
                                            else {}),
                                         "speedup_by_shape": {shape.name: shape.speedup for shape in shapes},
                                         studies.BEST_RECORDED_WITH: recorded_with,
                                         **({NOISE_KEY: max(noisy.values())} if noisy else {}),
                                         **({BUSY_KEY: True} if busy else {})})
    if busy:
        log.warning(CONTENDED.format(shapes=", ".join(filter(None, busy)) or "the shape timed",
                                     how=" (`autotune bench`)"))
    if noisy:
        log.warning("the timing behind the speedup was noisy: it is known to %s only; time the plan again on a "
                    "quiet machine (`autotune bench`)", ", ".join(f"±{100 * off:.0f} % at {name}"
                                                                  for name, off in noisy.items()))
    return result
