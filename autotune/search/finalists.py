"""The finalists: in every configured engine, the plans worth timing compiled (the fastest passing trials, the
uniform plans, fp32, each knob on the engine's fastest), built, called until they compile nothing more, and timed
together against fp32 (`race`)."""
from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from autotune.backends.base import hooked_modules
from autotune.capture import detach_clone, without_autograd
from autotune.engines import (
    CALLS_ITSELF,
    COMPILE_STATIC,
    ENTRIES,
    KNOBS,
    Calibration,
    CompileCache,
    Engine,
    EngineUnavailable,
    get_engine,
)
from autotune.errors import describe
from autotune.measure.latency import LatencyStats
from autotune.measure.measurer import latency_by_shape, ratios_to_fp32
from autotune.measure.memory import BuildMemory
from autotune.measure.module_latency import HOPELESS_RATIO
from autotune.measure.shapes import weighted_ratio
from autotune.measure.size import weight_bytes
from autotune.model_call import call, entry_paths
from autotune.plan import Plan, plan_key
from autotune.search.finalist_plans import (
    Finalist,
    below_a_missed_plan,
    engine_plans,
    kept_from_tuning,
    knobs_to_try,
    own_int8,
    trial_missed,
    uniform_finalists,
    without_far_misses,
    without_outrun,
)
from autotune.search.scores import GRAD_MODE_ATTR, OWN_CALLERS_ATTR, compiled_in_place
from autotune.search.trials import TrialRunner
from autotune.search.verdicts import Verdicts
from autotune.storage import study as studies
from autotune.timeout import interrupted_after, said_while_running
from autotune.tree import tensors

log = logging.getLogger("autotune")

ENGINE_TRIES = 2   # plans an engine fails on, with none built, before it is given up for the model
SETTLE_PASSES = 4  # passes over the compiled finalists after their first calls, until none compiles any more
CALLS_AGREE = 1e-3   # share of its outputs' scale within which a compiled finalist's two calls on one input agree
HEAT_ROUNDS = 5    # most timing rounds of the heat that picks, in a compiling engine, the finalist for its knobs
STILL_COMPILING_S = 60.0   # a compile running this long is said to be still running, and again each as long after
FIRST_COMPILE_S = 5.0   # the least a compile takes, until an engine's first says how long its take: none starts
                        # nearer the timeout (one begun 1 s before it was stopped "after 0 s", having built nothing)
# A finalist still compiling this many times as long as its engine's first finalist did, and at least SLOW_FLOOR_S, is
# stopped: on a Swin-V2, plain torch.compile of it took 70 s, and a plan whose eager int8 modules broke its graph into
# frames run at each stage's sizes (dynamo then compiles them for sizes that vary) compiled for over 16 minutes, in
# its first calls or in later ones (_settled); compiled for each shape apart, 29 s. So it is compiled again so where
# its engine can, and left out where that is slow too: a plan that slow to compile costs every process deploying it.
SLOW_RATIO = 5
SLOW_FLOOR_S = 180.0


@dataclass
class BuildLimits:
    """What no compiling finalist starts past. The run's timeout (`at`, time.monotonic(), None: none): no finalist
    starts compiling past it, nor where it is nearer than the engine's longest compile so far in this run (a Funnel
    transformer's second pt2e finalist, begun 5 s before a 240 s timeout, ended 138 s past it). Per engine: one
    engine's compiles say little of another's (a neural ODE's pt2e finalist, its solver loop unrolled by export,
    compiled in 138 s; plain torch.compile of it in 23 s). And the memory left (`memory`, None: not watched): every
    finalist stays alive until the race, and none starts where what is left is less than a build took. What the
    run's compiles said of sizes that vary (`static`, {engine: whether compiling shape by shape then worked}): an
    engine whose compile for them failed compiles its later finalists shape by shape from the start (on CvT each
    failed compile took a minute), or, where that failed too, never tries it again. And the first compile of each
    engine (`first_s`), past which a later one is too slow (`slow_after_s`); `first_said`: what that compile was,
    where it was not the engine's first in this run (a recorded best's, rebuilt)."""
    at: float | None
    memory: BuildMemory | None = None
    longest_s: dict[str, float] = field(default_factory=dict)
    static: dict[str, bool] = field(default_factory=dict)
    first_s: dict[str, float] = field(default_factory=dict)
    first_said: str | None = None

    def stop_reason(self, engine: str) -> str | None:
        """Why no finalist of `engine` starts now, or None."""
        if self.memory is not None and (too_little := self.memory.too_little()):
            return too_little
        if self.at is None or time.monotonic() + self.longest_s.get(engine, FIRST_COMPILE_S) < self.at:
            return None
        if time.monotonic() >= self.at:
            return "the run's timeout has passed"
        if engine not in self.longest_s:
            return f"the run's timeout is under {FIRST_COMPILE_S:g} s away, too near for a first compile"
        return (f"the run's timeout is nearer than the {engine} engine's longest compile so far "
                f"({self.longest_s[engine]:.0f} s)")

    def slow_after_s(self, engine: str) -> float | None:
        """How long a compile of `engine` may run before it is too slow (SLOW_RATIO); None before its first."""
        if engine not in self.first_s:
            return None
        return max(SLOW_FLOOR_S, SLOW_RATIO * self.first_s[engine])

    def bounding(self, engine: str) -> AbstractContextManager[None]:
        """The block, stopped where it is still running at the timeout (CompileTimedOut, from _ready) or past
        `slow_after_s` (a finalist left out): a compile cannot be told how long it will take (RWKV's time loop,
        unrolled by export, compiled for 13 minutes); and the memory it took, measured."""
        bounds = ExitStack()
        if self.memory is not None:
            bounds.enter_context(self.memory.measuring())
        timeout_s = math.inf if self.at is None else self.at - time.monotonic()
        slow_s = self.slow_after_s(engine) or math.inf
        if min(timeout_s, slow_s) < math.inf:
            bounds.enter_context(interrupted_after(min(timeout_s, slow_s),
                                                   _PastTimeout if timeout_s <= slow_s else _TooSlow))
        return bounds

    def too_slow(self, engine: str) -> str:
        """What a compile stopped past `slow_after_s` ran longer than, in words."""
        first = self.first_said or f"the {engine} engine's first"
        return f"over {SLOW_RATIO} times {first} ({self.first_s[engine]:.1f} s)"

    def slowness(self, engine: str) -> AbstractContextManager[None]:
        """The block, stopped past `slow_after_s` (_TooSlow), not at the timeout: calls that compile only where
        dynamo compiles again (_settled)."""
        slow_s = self.slow_after_s(engine)
        return nullcontext() if slow_s is None else interrupted_after(slow_s, _TooSlow)

    def note(self, finalist: Finalist) -> None:
        if finalist.runnable is not finalist.built:
            self.longest_s[finalist.engine] = max(self.longest_s.get(finalist.engine, 0.0), finalist.setup_s)
            self.first_s.setdefault(finalist.engine, finalist.setup_s)


class _PastTimeout(BaseException):
    """Raised into a compile at the run's timeout: not an Exception, which the compiler's own handlers would take
    for a failed kernel choice and go on."""


class _TooSlow(BaseException):
    """Raised into a compile running past BuildLimits.slow_after_s (a BaseException, as _PastTimeout is)."""


class CompileTimedOut(EngineUnavailable):
    """A finalist was still compiling when the run's timeout passed; its engine builds no more."""


def finalists(runner: TrialRunner, verdicts: Verdicts, deadline: float | None = None) -> dict[str, Finalist]:
    """Each engine's finalist plans in it, and the fp32 plan in every engine but eager (fp32 eager is the
    reference): an engine can make fp32 itself faster. An engine that cannot run this model at all is dropped
    with its reason logged and kept on the study (`engines_dropped`: {engine: reason}). Past `deadline` (the run's
    `timeout`, time.monotonic()), or too near it (BuildLimits), a compiling engine builds no further finalist:
    compiles take minutes on a model of hundreds of modules; nor where less memory is left than a compiling build
    took so far (at least twice the model's weights) and the weights again for the race: the kernel would end the
    run. The engines build a finalist each in turn (_build_in_turns); the eager engine's compile nothing, and are
    never stopped. A finalist evaluated as they are built goes into `verdicts`, as the winner's choice's are."""
    limits = BuildLimits(deadline, BuildMemory(weight_bytes(runner.fp32)))
    calibration = Calibration(runner.calibration_batches, runner.calibration, runner.variants)
    cache = _compile_cache(runner, any(engine != "eager" for engine in runner.config.engines))
    latency = studies.get_attr(runner.study, "module_latency_ms")
    candidates = {name: list(costs) for name, costs in latency.items()}   # the modules tuned, each dtype timed
    paying = uniform_finalists(candidates, latency)
    # Once, with the int8 plan the engines with kernels of their own get: both log what they leave out, and the far
    # misses' check reads the study.
    every = without_outrun(runner, without_far_misses(runner, {**paying, **own_int8(candidates, paying)}), latency)
    uniform = {dtype: plan for dtype, plan in every.items() if dtype in paying}
    knobs = knobs_to_try(runner, candidates, latency)
    engines = list(map(get_engine, runner.config.engines))
    dropped = {engine.name: reason for engine in engines
               if engine.lowers_unplanned and (reason := kept_from_tuning(runner.config))}
    for name, reason in dropped.items():
        log.warning("%s engine is not tried: %s", name, reason)
    # The inductor engine's turn comes first: its first finalist is plain torch.compile of the model, the peer a user
    # would pick, and the quickest compile. Under a 600 s timeout a 502-layer MLP's first pt2e finalist compiled
    # for 531 s, and the run returned fp32 where torch.compile ran 1.14x faster.
    builds = [_EngineBuilds(engine, engine_plans(runner, engine, uniform, every), dropped)
              for engine in sorted(engines, key=lambda engine: engine.name != "inductor")
              if engine.name not in dropped]
    _build_in_turns(builds, runner, calibration, cache, limits, verdicts)
    found: dict[str, Finalist] = {}
    failed_knobs: set[str] = set()   # knobs the model's tool could not handle: said once, not per engine
    for build in builds:
        if build.built:
            found.update(built := _settled(build.built, runner, limits))
            engine_knobs = [name for name in knobs
                            if KNOBS[name].engines is None or build.engine.name in KNOBS[name].engines]
            if engine_knobs and built:
                found.update(_knobbed(build.engine, engine_knobs, built, runner, cache, failed_knobs, limits,
                                      verdicts))
    if dropped:
        studies.set_attr(runner.study, "engines_dropped", dropped)
    found = _steady(_settled(found, runner, limits), runner)
    cache.save_compiler_artefacts()
    studies.set_attr(runner.study, "finalist_setup_s", {name: round(f.setup_s, 3) for name, f in found.items()})
    return found


def rebuilt(runner: TrialRunner, plan: Plan, engine: str, knobs: tuple[str, ...], name: str,
            static: bool = False, setup_s: float | None = None) -> Finalist:
    """One plan built again in `engine` with `knobs` (read back from the study's compile cache where it holds it),
    called until it compiles nothing more; compiled for each shape apart from the start where it was (`static`):
    its compile for sizes that vary failed, a minute or more on CvT, each time the study was run again. Stopped as
    too slow (SLOW_RATIO) against the `setup_s` its build took when the study was tuned, as a finalist is against its
    engine's first: nothing else bounds it.

    Raises:
        EngineUnavailable: building it or calling it failed, or was too slow.
    """
    compiling = engine != "eager"
    limits = BuildLimits(None, static={engine: True} if static else {},
                         first_s={engine: setup_s} if setup_s else {}, first_said="its build when the study was tuned")
    calibration = Calibration(runner.calibration_batches, runner.calibration, runner.variants)
    finalist = _ready(get_engine(engine), plan, runner, calibration, _compile_cache(runner, compiling), knobs,
                      name=name, compiling=limits if compiling else None)
    if not _settled({name: finalist}, runner, limits):
        raise EngineUnavailable(f"{engine}: it was left out after its first calls (the reason is logged above)")
    return finalist


def _compile_cache(runner: TrialRunner, compiling: bool) -> CompileCache:
    """The study's compile cache (none where no engine compiles), its compiler artefacts loaded."""
    cache = CompileCache.for_study(runner.config.compile_cache if compiling else None, runner.study.study_name,
                                   studies.built_from(runner.study, runner.fp32, runner.calibration_batches))
    cache.load_compiler_artefacts()
    return cache


def _not_built(runner: TrialRunner, engine: Engine, limits: BuildLimits) -> str | None:
    """Why a compiling engine's finalists are not built (logged), or None."""
    if stop := limits.stop_reason(engine.name):
        log.warning("%s: the %s engine's finalists are not built", stop, engine.name)
        return f"{stop}, so its finalists were not built"
    if engine.keeps_model:
        return None
    if callers := studies.get_attr(runner.study, OWN_CALLERS_ATTR):
        reason = f"eval_fn runs the model through its own methods ({', '.join(callers)}), which this engine's model " \
                 "does not have"
    elif entries := entry_paths(runner.batches):
        reason = f"eval_fn calls its submodules apart from its forward ({', '.join(entries)}), which this engine's " \
                 "model does not have"
    elif hooked := [name or "the model" for name in hooked_modules(runner.fp32)]:
        reason = f"forward hooks are registered on {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''}, " \
                 "which this engine's exported graph would not call"
    else:
        return None
    log.warning("the %s engine is not used: %s", engine.name, reason)
    return reason


class _EngineBuilds:
    """One engine's finalist plans, built one at a time (`step`). Where some plan was built, one that failed is
    left out with its reason logged (a part of the model the engine mishandles in that plan only); where none was,
    after ENGINE_TRIES failures or all of them, the engine cannot run this model, and is dropped with the first
    failure's reason (into `dropped`, {engine: reason}). A compiling engine that has built one stops at the run's
    `timeout`."""

    def __init__(self, engine: Engine, plans: dict[str, Plan], dropped: dict[str, str]):
        self.engine, self.dropped = engine, dropped
        self.suffix = "" if engine.name == "eager" else f" ({engine.name})"
        self.waiting = list(plans.items())
        self.built: dict[str, Finalist] = {}
        self.failures: list[tuple[str, EngineUnavailable]] = []

    def step(self, runner: TrialRunner, calibration: Calibration, cache: CompileCache, limits: BuildLimits,
             wanted: Callable[[Plan], bool] | None = None) -> bool:
        """Builds the next plan `wanted` says to build now (None: any); whether there is one more such."""
        if self.engine.name in self.dropped:    # on the pass after the one that dropped it
            return False
        if self.suffix and not self.built:
            if not self.failures and (reason := _not_built(runner, self.engine, limits)):
                return self._drop(reason)
            if self.failures and limits.stop_reason(self.engine.name):
                return self._given_up()
        ready = [index for index, (_, plan) in enumerate(self.waiting) if wanted is None or wanted(plan)]
        if not ready:
            # e.g. the compiled engine, where no passing plan holds int8 (said once, on the last pass)
            if wanted is None and not self.built and not self.failures:
                log.info("the %s engine builds no finalist: it realises none of the plans worth timing",
                         self.engine.name)
            return False
        if self.suffix and self.built and (stop := limits.stop_reason(self.engine.name)):
            log.warning("%s: %d more finalists of the %s engine are not built", stop,
                        len(self.waiting), self.engine.name)
            return self._finish()
        name, plan = self.waiting.pop(ready[0])
        name += self.suffix
        try:
            self.built[name] = _ready(self.engine, plan, runner, calibration, cache, name=name,
                                      compiling=limits if self.suffix else None)
            limits.note(self.built[name])
        except CompileTimedOut as exc:
            if self.built:
                log.warning("%s is left out: %s", name, exc)
                return self._finish()
            if self.failures:   # what the engine failed on says more than the timeout
                return self._given_up()
            log.warning("the %s engine is not used: %s", self.engine.name, exc)
            return self._drop(str(exc))
        except EngineUnavailable as exc:
            self.failures.append((name, exc))
        if not self.built and (len(self.failures) == ENGINE_TRIES or not self.waiting):
            return self._given_up()
        return bool(self.waiting) or self._finish()

    def _given_up(self) -> bool:
        log.warning("the %s engine cannot run this model, so it is not used: %s", self.engine.name,
                    self.failures[0][1])
        return self._drop(str(self.failures[0][1]))

    def _drop(self, reason: str) -> bool:
        self.dropped[self.engine.name] = reason
        self.waiting.clear()
        return False

    def _finish(self) -> bool:
        for name, exc in self.failures:
            log.warning("%s is left out: %s", name, exc)
        self.waiting.clear()
        return False


def _build_in_turns(builds: list[_EngineBuilds], runner: TrialRunner, calibration: Calibration, cache: CompileCache,
                    limits: BuildLimits, verdicts: Verdicts) -> None:
    """Every engine's finalists, a plan of each engine in turn: with a timeout, every engine then builds its first
    before any builds its second (one engine at a time, a BEiT's pt2e finalists took its 240 s timeout, and the
    inductor engine, plain torch.compile among its plans, built none). The plans whose trials missed the tolerance
    come after all the others (`trial_missed`): on a 12-layer encoder the compiled engine's uniform int8, 3.4 tolerances
    lost in its trial, compiled for 88 s first, missed again, and the timeout then left two lowp finalists out. The
    inductor engine's plans holding int8 come after every other engine's plans, where the compiled engine's int8
    does not beat them (_worth_compiling)."""
    inductor, compiled = _engine_builds(builds, "inductor"), _engine_builds(builds, "compiled")
    later = []
    if inductor is not None and compiled is not None:
        later = [(name, plan) for name, plan in inductor.waiting if "int8" in plan.values()]
        inductor.waiting = [(name, plan) for name, plan in inductor.waiting if "int8" not in plan.values()]
    _turns(builds, runner, calibration, cache, limits)
    if later and inductor.engine.name not in inductor.dropped:
        # past the timeout no heat is timed: the engine's step says the plans are not built
        stopped = limits.stop_reason(inductor.engine.name) is not None
        inductor.waiting = later if stopped else _worth_compiling(later, builds, runner, verdicts)
        _turns([inductor], runner, calibration, cache, limits)


def _engine_builds(builds: list[_EngineBuilds], engine: str) -> _EngineBuilds | None:
    return next((build for build in builds if build.engine.name == engine), None)


def _turns(builds: list[_EngineBuilds], runner: TrialRunner, calibration: Calibration, cache: CompileCache,
           limits: BuildLimits) -> None:
    for wanted in (lambda plan: not trial_missed(runner, plan), None):
        building = list(builds)
        while building:
            building = [build for build in building if build.step(runner, calibration, cache, limits, wanted)]


def _worth_compiling(plans: list[tuple[str, Plan]], builds: list[_EngineBuilds], runner: TrialRunner,
                     verdicts: Verdicts) -> list[tuple[str, Plan]]:
    """Of the inductor engine's `plans` holding int8, those the compiled engine's fastest int8 finalist does not
    beat as the plan runs eagerly (its eager finalist), timed with every finalist built so far in a heat. The
    inductor engine runs int8 modules eagerly between its graphs, each a graph break: over 16 runs of unseen models,
    23 such finalists (up to 104 s of compiling each, 472 s in all) won none, and ran 0.71-1.18x their plan's eager
    time; where the compiled engine's int8 ran faster than that eager time, one of its finalists beat them. On a
    Data2Vec it did not (pt2e's int8 at 0.95 of fp32's time, the plan eagerly at 0.51), nor where the compiled engine
    built no int8 plan (export failed, eval_fn calls generate): there they are the only int8 compiled.

    The compiled finalist they are left out for should pass: its numerics are its own (activation ranges fixed by
    calibration), and on a SigLIP and an HGNet, left unjudged, it missed by 1.6 and 100 tolerances once the plans it
    barred were gone. Where it raced ahead of every other finalist likely to pass it is evaluated first, the call
    the winner's choice would make of it anyway; where another raced ahead of it, that one is judged first for the
    win and this call could be spent for nothing (on a VideoMAE, bf16 finalists at 0.68 of fp32's time, the bar at
    0.90), so it bars them unjudged. One whose plan's trial, or a part of it, missed (`trial_missed`) bars nothing. Each
    plan left out is logged."""
    compiled, eager = _engine_builds(builds, "compiled"), _engine_builds(builds, "eager")
    holding = {name: finalist for name, finalist in compiled.built.items()
               if "int8" in finalist.plan.values() and not trial_missed(runner, finalist.plan)}
    eagerly = {plan_key(finalist.plan): name for name, finalist in (eager.built.items() if eager else ())}
    twins = {name: eagerly[plan_key(plan)] for name, plan in plans if plan_key(plan) in eagerly}
    if not holding or not twins:
        return plans
    built = {name: finalist for build in builds for name, finalist in build.built.items()}
    _, ratio = race(runner, {name: finalist.runnable for name, finalist in built.items()}, HEAT_ROUNDS)
    slowest_twin = max(ratio[twin] for twin in twins.values())
    ahead = min((ratio[name] for name, finalist in built.items() if name not in holding   # likely to pass
                 and not trial_missed(runner, finalist.plan) and not verdicts.missed(finalist)), default=math.inf)
    bar = None
    for name in sorted(holding, key=ratio.get):
        if ratio[name] >= slowest_twin:
            break
        if ratio[name] > ahead:
            bar = name
            break
        log.info("%s is evaluated as the finalists are built: it ran at %.2f of fp32's time in a heat, ahead of every "
                 "other finalist, and of the inductor engine's plans holding int8 as they run eagerly", name,
                 ratio[name])
        if verdicts.passing_score(name, holding[name]) is not None:
            bar = name
            break
    if bar is None:
        return plans
    kept = []
    for name, plan in plans:
        if name not in twins or ratio[twins[name]] <= ratio[bar]:
            kept.append((name, plan))
        else:
            log.info("%s (inductor) is not built: %s ran at %.2f of fp32's time in a heat, its plan eagerly at %.2f, "
                     "as the inductor engine would run its int8 modules, between its graphs", name, bar,
                     ratio[bar], ratio[twins[name]])
    return kept


def _knob_base(built: dict[str, Finalist], runner: TrialRunner) -> tuple[str, Plan, float | None]:
    """The finalist of one engine its knobs are tried on, by name, its plan, and its ratio to fp32 in the heat that
    chose it (None where none was timed): where the engine compiles, the fastest of its (settled) finalists timed
    together, in at most HEAT_ROUNDS rounds (one alone too: its ratio says whether knobs can pay, `_knobbed`); else
    the first, the fastest passing trial. The search ranks plans by
    their eager timing, which says little of a plan compiled: on a MobileNet the inductor engine's fastest trial plan
    (its int8 modules each a graph break) raced at 1.06x fp32's time where its uniform bf16 plan raced at 0.49x, and
    the knobs went to the former."""
    first = next(iter(built))
    if all(finalist.runnable is finalist.built for finalist in built.values()):
        return first, built[first].plan, None
    _, ratio = race(runner, {name: finalist.runnable for name, finalist in built.items()}, HEAT_ROUNDS)
    fastest = min(built, key=ratio.get)
    return fastest, built[fastest].plan, ratio[fastest]


def race(runner: TrialRunner, models: dict[str, nn.Module], repeats: int
          ) -> tuple[dict[str, dict[str, LatencyStats]], dict[str, float]]:
    """`models` timed together with fp32 at every shape, in at most `repeats` rounds: the timings, and each one's
    (and fp32's) weighted ratio to fp32. The models were called at every shape as they were built and settled
    (_ready, _settled); fp32 is called at each here, so none needs a warm-up call."""
    with as_eval_fn_calls(runner):
        for shape in runner.shapes:
            call(runner.fp32, shape.inputs)
        by_shape = latency_by_shape(runner.measurer, {"fp32": runner.fp32, **models}, runner.shapes, repeats,
                                    warmup=0)
    return by_shape, {name: weighted_ratio(ratios_to_fp32(by_shape, name), runner.shapes)
                      for name in ["fp32", *models]}


def _knobbed(engine: Engine, knobs: list[str], built: dict[str, Finalist], runner: TrialRunner, cache: CompileCache,
             failed: set[str], limits: BuildLimits, verdicts: Verdicts) -> dict[str, Finalist]:
    """`knobs` tried on one of the engine's `built` finalists (_knob_base, _with_knobs), not one evaluated as they
    were built that missed (on an HGNet a compiled int8 finalist's channels_last twin compiled for 20 s, computing
    what its base had missed by 100 tolerances). A compiling engine past the run's timeout tries none, and times no
    heat to pick their finalist (a ViT's heats ran 40 s past it)."""
    if engine.name != "eager" and (stop := limits.stop_reason(engine.name)):
        log.warning("%s: %s is not tried in the %s engine", stop, ", ".join(knobs), engine.name)
        return {}
    built = {name: finalist for name, finalist in built.items() if not verdicts.missed(finalist)}
    if not built:
        log.info("%s is not tried in the %s engine: its finalists missed when evaluated", ", ".join(knobs),
                 engine.name)
        return {}
    name, plan, ratio = _knob_base(built, runner)
    if ratio is not None and ratio >= HOPELESS_RATIO:
        # Knobs change layouts, fold a layer or cast matmuls: none wins back half the time. On an EfficientNet every
        # inductor finalist ran 30x fp32's time (inductor made its pooler's 1280-wide AvgPool2d, over a 5x5 map, a
        # 1280x1280 loop per output) and its three knobs cost 42 s of compiling, and 2 s a call to settle and race.
        log.warning("%s is not tried in the %s engine: its fastest finalist, %s, ran %.1fx fp32's time in a heat",
                    ", ".join(knobs), engine.name, name, ratio)
        return {}
    return _with_knobs(engine, knobs, (name, plan), runner, cache, failed, limits)


def _with_knobs(engine: Engine, knobs: list[str], base: tuple[str, Plan], runner: TrialRunner,
                cache: CompileCache, failed: set[str], limits: BuildLimits) -> dict[str, Finalist]:
    """The finalist `base` (its name and plan) with each of `knobs` (those with an effect in this engine) until
    the run's `timeout`; a knob the model's tool or the engine then cannot handle is left out with its reason
    logged."""
    found: dict[str, Finalist] = {}
    compiling = limits if engine.name != "eager" else None    # the eager engine's knobs compile nothing
    for count, knob in enumerate(KNOBS[name] for name in knobs):
        if compiling is not None and (stop := compiling.stop_reason(engine.name)):
            log.warning("%s: %s is not tried with %s in the %s engine", stop,
                        ", ".join(knobs[count:]), base[0], engine.name)
            break
        name = f"{base[0]} +{knob.name}"
        if (below := below_a_missed_plan(runner, engine.name, base[1], (knob.name,))) is not None:
            log.info("%s is not built: %s", name, below)
            continue
        # Lowered modules are built afresh: the runner's reusable ones were lowered from the model without it.
        calibration = Calibration(runner.calibration_batches, runner.calibration)
        try:
            found[name] = _ready(engine, base[1], runner, calibration, cache, (knob.name,), name=name,
                                 compiling=compiling)
            limits.note(found[name])
        except CompileTimedOut as exc:
            log.warning("%s is left out: %s", name, exc)
            break
        except Exception as exc:   # a model the knob's tool cannot handle (fx tracing), or the engine then
            level = logging.INFO if knob.name in failed else logging.WARNING
            log.log(level, "%s is not tried in the %s engine: %s", knob.name, engine.name, describe(exc))
            failed.add(knob.name)
    return found


def _ready(engine: Engine, plan: Plan, runner: TrialRunner, calibration: Calibration, cache: CompileCache,
           knobs: tuple[str, ...] = (), *, name: str = "", compiling: BuildLimits | None = None) -> Finalist:
    """`plan` built in `engine` (or read back from the study's compile cache) and called once at every shape,
    which is when torch.compile compiles: the seconds all that took are the plan's set-up cost in this engine
    (kept on the study). In an engine that compiles (`compiling`: the run's timeout), said as it starts and ends
    (a compile takes seconds to minutes: a run that says nothing meanwhile looks stuck), and stopped at the timeout.

    Raises:
        CompileTimedOut: still compiling at the run's timeout.
        EngineUnavailable: building the plan or the first calls failed (e.g. the compiler could not handle the
            model): after the search, an engine's failure must not cost the run its result.
    """
    if compiling is None:
        return _built_and_called(engine, plan, runner, calibration, cache, knobs, BuildLimits(None))
    log.info("finalist %s: building and compiling", name)
    started = time.perf_counter()
    try:
        with compiling.bounding(engine.name), said_while_running(
                STILL_COMPILING_S, lambda seconds: log.info("finalist %s: still compiling (%.0f s)", name, seconds)):
            finalist = _built_and_called(engine, plan, runner, calibration, cache, knobs, compiling)
    except _PastTimeout:
        raise CompileTimedOut(f"the run's timeout passed while {name} compiled (after "
                              f"{time.perf_counter() - started:.0f} s), so it builds no more finalists") from None
    except _TooSlow:
        raise EngineUnavailable(
            f"its compile was stopped after {time.perf_counter() - started:.0f} s, {compiling.too_slow(engine.name)}: "
            "a plan that slow to compile costs as much wherever it is deployed") from None
    if finalist.runnable is not finalist.built:
        log.info("finalist %s built and compiled in %.1f s", name, finalist.setup_s)
    return finalist


def _built_and_called(engine: Engine, plan: Plan, runner: TrialRunner, calibration: Calibration,
                      cache: CompileCache, knobs: tuple[str, ...], limits: BuildLimits) -> Finalist:
    started = time.perf_counter()
    try:
        built = cache.build(engine, runner.fp32, plan, calibration, runner.inputs, knobs)
    except EngineUnavailable:
        raise
    except Exception as exc:   # the libraries an engine builds with raise many kinds
        raise EngineUnavailable(f"{engine.name}: building the plan failed: {describe(exc)}") from exc
    if compiled_in_place(runner.study):
        setattr(built, CALLS_ITSELF, True)   # so eval_fn's calls through its methods run compiled (CALLS_ITSELF)
        setattr(built, ENTRIES, entry_paths(runner.batches))   # and the encoder generate calls apart
    if limits.static.get(engine.name):
        setattr(built, COMPILE_STATIC, True)
    runnable = engine.runnable(built)
    try:
        _called_at_every_shape(runnable, runner)
    except Exception as exc:   # compilers raise many kinds; each means this engine cannot run the model
        runnable = _compiled_shape_by_shape(engine, built, runner, limits,
                                            f"{engine.name}: the first call failed", exc)
    except _TooSlow as exc:
        if not _may_compile_static(engine, built, limits):
            raise
        slow = _slow_calls(f"{engine.name}: its first calls", engine.name, limits)
        runnable = _compiled_shape_by_shape(engine, built, runner, limits, slow, exc)
    return Finalist(plan, engine.name, built, runnable, time.perf_counter() - started, knobs)


def _called_at_every_shape(runnable: nn.Module, runner: TrialRunner) -> None:
    with as_eval_fn_calls(runner):
        for shape in runner.shapes:
            call(runnable, shape.inputs)


def _compiled_shape_by_shape(engine: Engine, built: nn.Module, runner: TrialRunner, limits: BuildLimits,
                             failed: str, exc: BaseException) -> nn.Module:
    """`built` compiled for each shape apart and called at every shape, where a call compiled for sizes that vary
    raised `exc` or was too slow (`failed`: how that call is said); `limits.static` learns how that went.

    Raises:
        EngineUnavailable: `exc`'s call was compiled so already, the engine cannot compile so, or it failed or
            was too slow too.
        _PastTimeout: the run's timeout passed meanwhile.
    """
    said = f"{failed}: {describe(exc)}" if isinstance(exc, Exception) else failed
    if not _may_compile_static(engine, built, limits):
        raise EngineUnavailable(said) from exc
    log.info("%s; compiling it again for each shape apart", said)
    setattr(built, COMPILE_STATIC, True)
    runnable = engine.runnable(built)
    started = time.perf_counter()
    try:
        with limits.bounding(engine.name):
            _called_at_every_shape(runnable, runner)
    except _TooSlow:
        limits.static[engine.name] = False
        raise EngineUnavailable(f"{said}; compiled for each shape apart, it was stopped after "
                                f"{time.perf_counter() - started:.0f} s too") from None
    except Exception as again:
        limits.static[engine.name] = False
        raise EngineUnavailable(f"{said}; compiled for each shape apart: {describe(again)}") from again
    limits.static[engine.name] = True
    return runnable


def _may_compile_static(engine: Engine, built: nn.Module, limits: BuildLimits) -> bool:
    """Whether `built`, compiled for sizes that vary, may be compiled again for each shape apart: it was not so
    already, its engine can, and compiling so has not failed in the run."""
    return (not getattr(built, COMPILE_STATIC, False) and engine.compiles_static_when_marked
            and limits.static.get(engine.name) is not False)


def _slow_calls(calls: str, engine: str, limits: BuildLimits) -> str:
    return f"{calls} compiled for over {limits.slow_after_s(engine):.0f} s, {limits.too_slow(engine)}"


def _settled(found: dict[str, Finalist], runner: TrialRunner, limits: BuildLimits) -> dict[str, Finalist]:
    """`found`, with every compiled finalist called at every shape until a pass compiles nothing more (at most
    SETTLE_PASSES passes; the seconds go to its setup_s), so the race times compiled code, not compiling. One call
    at a shape is not always the last compile there: dynamo may then make a size dynamic (one block class run at
    several widths), and finalists share the frames below a graph break, so one finalist's new entries can route
    another's next call into frames it has not run. On a MobileNet with int8 squeeze-excitation convolutions the
    race timed inductor finalists at up to 155x fp32's time that way, and never chose them. A finalist whose calls
    now fail (they did not at first: a size made dynamic), or compile past `limits.slowness` (a Swin-V2's inductor
    finalist compiled for sizes that vary for over 11 minutes here, built in 109 s), is compiled again for each shape
    apart (_compiled_shape_by_shape), or, where that fails too, left out with its reason logged. One that compiled again
    in every pass compiles at every call, and is left out with dynamo's reason (_recompiling)."""
    compiled = {name: finalist for name, finalist in found.items() if finalist.runnable is not finalist.built}
    shapes = runner.shapes
    recompiled: dict[str, list[str]] = {name: [] for name in compiled}   # each pass's reason it compiled again
    for _ in range(SETTLE_PASSES):
        compiling = False
        for name, finalist in list(compiled.items()):
            started = time.perf_counter()
            try:
                with as_eval_fn_calls(runner), limits.slowness(finalist.engine):
                    try:
                        with torch.compiler.set_stance("fail_on_recompile"):
                            for shape in shapes:
                                call(finalist.runnable, shape.inputs)
                    except RuntimeError as again:   # it would compile: let it, and pass over all of them again
                        compiling = True
                        recompiled[name].append(str(again))
                        for shape in shapes:
                            call(finalist.runnable, shape.inputs)
            except (Exception, _TooSlow) as exc:   # compilers raise many kinds
                failed = ("a call after its first failed" if isinstance(exc, Exception)
                          else _slow_calls("a call after its first", finalist.engine, limits))
                try:
                    finalist.runnable = _compiled_shape_by_shape(get_engine(finalist.engine), finalist.built, runner,
                                                                 limits, failed, exc)
                    compiling = True
                except (EngineUnavailable, _PastTimeout) as unavailable:
                    log.warning("%s is left out: %s", name, unavailable if isinstance(unavailable, EngineUnavailable)
                                else f"{failed}; the run's timeout passed while it compiled for each shape apart")
                    del compiled[name], found[name]
                    continue
            finalist.setup_s += time.perf_counter() - started
        if not compiling:
            break
    for name in compiled:
        if len(recompiled[name]) == SETTLE_PASSES:
            log.warning("%s is left out: %s", name, _recompiling(recompiled[name][-1]))
            del found[name]
    return found


def _steady(found: dict[str, Finalist], runner: TrialRunner) -> dict[str, Finalist]:
    """`found` without the compiled finalists whose two calls on one input disagree (_changing_between_calls)."""
    for name, finalist in list(found.items()):
        if finalist.runnable is not finalist.built and (changing := _changing_between_calls(finalist, runner)):
            log.warning("%s is left out: %s", name, changing)
            del found[name]
    return found


def _changing_between_calls(finalist: Finalist, runner: TrialRunner) -> str | None:
    """Why a compiled finalist answers one input otherwise at each call, or None where two calls on copies of the
    first shape's inputs, random ops seeded alike, agree to within CALLS_AGREE of the output's scale. Evaluated once
    and served for ever, such a model is not the one its score was measured on: frozen, a RoCBert's int8 graph wrote
    into a constant of its own at each call (until frozen.sums_kept_out_of_constants), and by the third its outputs
    were 30 % of their scale off. A compiler's failure is not this check's to judge: the race meets it."""
    outputs = []
    try:
        with as_eval_fn_calls(runner):
            for _ in range(2):
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    out = call(finalist.runnable, detach_clone(runner.shapes[0].inputs))
                # copies: a CUDA graph's replay writes its next output where it wrote this one
                outputs.append([t.detach().to(torch.float32, copy=True) for t in tensors(out)])
    except Exception:   # noqa: BLE001 - compilers raise many kinds
        return None
    for first, second in zip(*outputs):
        scale = float(first.abs().nan_to_num(posinf=0.0, neginf=0.0).max()) if first.numel() else 0.0
        if first.shape != second.shape or not torch.allclose(first, second, rtol=0.0, atol=CALLS_AGREE * scale,
                                                             equal_nan=True):
            apart = float((first - second).abs().nan_to_num(nan=0.0).max()) if first.shape == second.shape else None
            how = f"{apart / scale:.2g} of their scale apart" if apart is not None and scale > 0 else "apart"
            return (f"two calls on the same inputs gave outputs {how}: it keeps state that changes what it "
                    "computes, and would not answer as it was evaluated")
    return None


def _recompiling(message: str) -> str:
    """What a finalist compiling again at every call is said with: where and why dynamo compiled again, read from
    the fail_on_recompile error `message`. On a UperNet the inductor engine's plan with int8 convolutions in its
    pyramid pooling (each a graph break) compiled again at every call, as a graph break inside the argument of
    `psp_outs.extend(...)` makes dynamo guard the rest of the frame on that list's bound method, a new object at
    each call; raced, it ran 3.7x fp32's time, and any process deploying it would compile 256 times first."""
    where = re.search(r"filename: '([^']*)', function name: '([^']*)', line number: (\d+)", message)
    failures = re.findall(r"^\s*- [^:]*: (.*)$", message, re.MULTILINE)
    said = f"{where[2]} at {os.path.basename(where[1])}:{where[3]}" if where else "a compiled frame"
    because = f": {failures[-1]}" if failures else ""
    return (f"it compiled again in each of {SETTLE_PASSES} passes over every shape, as it would at every call "
            f"({said}{because})")


def as_eval_fn_calls(runner: TrialRunner) -> AbstractContextManager:
    """The autograd mode eval_fn called the model in (capture.without_autograd), for calls of finalists."""
    return without_autograd(studies.get_attr(runner.study, GRAD_MODE_ATTR))


