"""The verified winner: the finalists raced against fp32, and the fastest re-evaluated until one keeps the
tolerance; fp32 where none does."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from torch import nn

from autotune.clone import clone
from autotune.config.tuning import TuningConfig
from autotune.engines import EngineUnavailable
from autotune.errors import describe
from autotune.measure.latency import LatencyStats
from autotune.measure.measurer import latency_by_shape, ratios_to_fp32
from autotune.measure.shapes import weighted_ratio
from autotune.plan import Plan, is_baseline, plan_of_key
from autotune.search.finalist_plans import fp32_plan
from autotune.search.finalists import Finalist, as_eval_fn_calls, finalists, race, rebuilt
from autotune.search.scores import scored
from autotune.search.trials import TrialRunner
from autotune.search.verdicts import Verdicts, eval_timeout
from autotune.storage import study as studies

log = logging.getLogger("autotune")

# A passing finalist timed again on its own is raced again beside those that raced this much faster than it then ran
# (a race figure reads a few per cent fast anyway: the fastest of noisy ones); one of them is evaluated only where it
# beats it there by half as much, as each finalist evaluated costs an eval_fn call.
OUTRACED = 0.10
PAST_TIMEOUT_ROUNDS = 5   # most rounds of the finalists' race once the run's timeout has passed


@dataclass
class Winner:
    plan: Plan
    engine: str
    model: nn.Module
    accuracy: float
    by_shape: dict[str, dict[str, LatencyStats]]   # {shape: {"fp32": ..., "best": ...}}, re-timed together
    ratio: float                                   # the weighted latency ratio to fp32 over the shapes
    setup_s: float = 0.0                           # its build and first calls (compilation) in its engine
    knobs: tuple[str, ...] = ()                    # model-level knobs it runs with
    name: str = "fp32"                             # its finalist's name ("trial 12 (inductor) +fold_bn")
    recorded: bool = False                         # the study's recorded best, built again (_recorded_winner)
    built: nn.Module | None = None                 # `model` before compiling, what its engine saves; None: `model`


def verified_winner(runner: TrialRunner, deadline: float | None = None) -> Winner:
    """Re-times the finalists interleaved with fp32 and re-evaluates the fastest; the first that passes and, timed
    once more on its own (the figures reported), runs faster than fp32 wins, unless finalists after it raced
    OUTRACED faster than it then ran: those are raced again beside it (_challenged). fp32 if none passes and runs
    faster."""
    if (recorded := _recorded_winner(runner)) is not None:
        return recorded
    config = runner.config
    verdicts = Verdicts(runner)
    candidates = finalists(runner, verdicts, deadline)
    models = {name: finalist.runnable for name, finalist in candidates.items()}
    rounds = _race_rounds(config, deadline)
    by_shape, ratio = race(runner, models, rounds)
    studies.set_attr(runner.study, "finalist_ratio", {name: round(ratio[name], 4) for name in models})
    for name in sorted(models, key=ratio.get):
        if ratio[name] >= 1.0:
            break
        accuracy = verdicts.passing_score(name, candidates[name])
        if accuracy is None:
            continue
        winner, _ = _timed_again(runner, candidates[name], name, accuracy, None)
        if winner.ratio < 1.0:
            return _challenged(runner, candidates, ratio, winner, verdicts, rounds)
        log.warning("%s, timed again against fp32 on its own, ran no faster (%.2fx its time); trying the next",
                    name, winner.ratio)
        verdicts.add(name, "timed again on its own, no faster than fp32")
    log.warning("no plan both met the accuracy requirement and ran faster than the model as handed over (%s eager); "
                "keeping it%s", runner.kept, _coarse_losses(runner))
    return _fp32_winner(runner, by_shape)


def _challenged(runner: TrialRunner, candidates: dict[str, Finalist], raced: dict[str, float], best: Winner,
                verdicts: Verdicts, rounds: int) -> Winner:
    """`best`, or a finalist that raced OUTRACED faster than `best` then ran on its own: those are raced again
    beside it, and the fastest there that beats it, passes and, timed beside it once more, runs faster wins. A race
    on a busy host can read any one of them far too fast: a ShuffleNet plan raced at 0.48 of fp32 and ran at 0.94,
    where the fp32 plan compiled raced at 0.57; an eager MobileNet plan raced at 0.24 and ran at 0.82, where its
    compiled plans raced at 0.32 and 0.40 (and one challenger, no faster beside it, had ended the search for one)."""
    rivals = [name for name in sorted(candidates, key=raced.get)    # but those already judged
              if name not in (best.name, *verdicts.outcomes) and raced[name] < best.ratio * (1 - OUTRACED)]
    if not rivals:
        return best
    log.warning("%s, timed again on its own, ran at %.2f of fp32's time, where %s raced at %.2f: %s raced again "
                "beside it", best.name, best.ratio, rivals[0], raced[rivals[0]],
                "that one is" if len(rivals) == 1 else f"the {len(rivals)} finalists that raced that much faster are")
    _, again = race(runner, {best.name: best.model, **{name: candidates[name].runnable for name in rivals}}, rounds)
    for name in sorted(rivals, key=again.get):
        if again[name] >= again[best.name] * (1 - OUTRACED / 2):
            break
        accuracy = verdicts.passing_score(name, candidates[name])
        if accuracy is None:
            continue
        winner, rival_ratio = _timed_again(runner, candidates[name], name, accuracy, best)
        if winner.ratio >= min(rival_ratio, 1.0):
            verdicts.add(name, f"timed again beside {best.name}, no faster than it")
            continue
        verdicts.add(best.name, f"timed again on its own at {best.ratio:.3f} of fp32's time, slower than {name}")
        return winner
    return best


def _coarse_losses(runner: TrialRunner) -> str:
    """Where no lowered plan passed: the smallest loss any showed, and, where every loss is a whole multiple of it
    (an accuracy over a few samples moves by one sample's worth), that the eval set may be too small to show a
    loss within the tolerance. Empty where a plan passed or too few were evaluated to tell."""
    losses = sorted(outcome.loss for key, outcome in runner.outcomes.items() if not is_baseline(plan_of_key(key)))
    if not losses or losses[0] <= runner.config.tolerable_loss:
        return ""
    least = losses[0]
    text = f"; every plan tried lost at least {least:.4g} where {runner.config.tolerable_loss:.4g} is tolerable"
    whole_steps = all(abs(loss / least - round(loss / least)) < 1e-6 for loss in losses)
    if runner.config.tolerable_loss > 0 and len(losses) >= 3 and whole_steps:   # none tolerated: no eval set helps
        text += (f" and every loss was a whole multiple of {least:.4g}, as where one sample of the eval set weighs "
                 "that much: a larger eval set shows smaller losses, so that some plan can pass")
    return text


def _race_rounds(config: TuningConfig, deadline: float | None) -> int:
    """The race's most rounds: `repeats`, or PAST_TIMEOUT_ROUNDS once the run's timeout has passed (a ViT's race of
    ten finalists, at 2 s a call on a busy host, ran minutes past it). It stops sooner where it is settled."""
    if deadline is not None and time.monotonic() >= deadline and config.repeats > PAST_TIMEOUT_ROUNDS:
        log.info("the run's timeout has passed: the finalists are raced in at most %d rounds, not %d",
                 PAST_TIMEOUT_ROUNDS, config.repeats)
        return PAST_TIMEOUT_ROUNDS
    return config.repeats


def _recorded_winner(runner: TrialRunner) -> Winner | None:
    """The study's recorded best, where no trial was evaluated since and the engines and knobs configured are the
    same: built again and timed against fp32 once more, its score the recorded one. A finished study run again
    raced its finalists anew, and on a busy host each run returned another plan and spent an eval_fn call
    re-evaluating it. None where there is none to reuse, or it no longer builds (logged)."""
    if (best := studies.standing_best(runner.study, runner.config)) is None:
        return None
    # Scored again as this process joined the study (scores.rescored): a score that moved within the tolerance
    # means eval_fn's data changed, and the best is scored again on it.
    rescored = bool(runner.rescored)
    name, knobs = best.get("finalist", "fp32"), tuple(best.get("knobs", ()))
    log.info("the study's search is done and its best plan (%s) was recorded after its last trial: it is built and "
             "timed again, not chosen again (`autotune bench` times it; %s)", name, studies.SEARCHES_ON)
    if is_baseline(best["plan"]) and best["engine"] == "eager" and not knobs:
        with as_eval_fn_calls(runner):
            by_shape = latency_by_shape(runner.measurer, {"fp32": runner.fp32}, runner.shapes, runner.config.repeats)
        return _fp32_winner(runner, by_shape, recorded=True)
    try:
        finalist = rebuilt(runner, best["plan"], best["engine"], knobs, name, best.get("compile_static", False),
                           best.get("setup_s"))
    except EngineUnavailable as exc:
        log.warning("the study's best plan does not build again (%s): its finalists are chosen again", describe(exc))
        return None
    accuracy = best["accuracy"] if not rescored else _scored_again(runner, finalist, name)
    if accuracy is None:
        return None
    winner, _ = _timed_again(runner, finalist, name, accuracy, None)
    winner.recorded = True
    return winner


def _scored_again(runner: TrialRunner, finalist: Finalist, name: str) -> float | None:
    """The recorded best's score on eval_fn's data now (one eval_fn call), where it still keeps the tolerance of
    the fp32 model's score there; None (logged) where it does not: its finalists are then chosen again, each judged
    on that data. Resumed on a changed eval set, a best within the tolerance before was returned at a loss of 1.15 %
    where 1 % was tolerable, with its old scores shown as current."""
    runner.eval_calls += 1
    with as_eval_fn_calls(runner):
        accuracy = scored(runner.eval_fn, finalist.runnable, eval_timeout(runner.config, finalist))
    loss = runner.config.accuracy_loss(runner.baseline, accuracy)
    if runner.config.passes(runner.baseline, accuracy):
        return accuracy
    log.warning("the study's best plan (%s) scores %.6g on eval_fn's data now, a loss of %.4g where %.4g is "
                "tolerable: its finalists are chosen again", name, accuracy, loss, runner.config.tolerable_loss)
    return None


def _fp32_winner(runner: TrialRunner, by_shape: dict[str, dict[str, LatencyStats]], recorded: bool = False
                 ) -> Winner:
    return Winner(fp32_plan(runner), "eager", clone(runner.fp32), runner.baseline, _fp32_and(by_shape, "fp32"), 1.0,
                  recorded=recorded)


def _timed_again(runner: TrialRunner, finalist: Finalist, name: str, accuracy: float, rival: Winner | None
                 ) -> tuple[Winner, float]:
    """The finalist as a winner, timed against fp32 once more, on its own or beside the `rival` it may replace, and
    the rival's ratio to fp32 in that timing (1.0 without one). Its figure in the race is the fastest of many noisy
    ones, which reads high (3-19 % on unseen models), so the speedup reported is this one; where it then runs no
    faster than fp32, the next finalist is tried (on a busy host a ResNet's race timed an fp16 plan at 0.49x fp32,
    alone it ran at 1.14x, and fp32 eager was returned where the fp32 plan compiled ran 1.5x faster). A challenger
    and its rival are compared within one timing, as every ratio here is: timed apart, a busy host's noise decided
    (on a MobileBERT an eager plan read 4.1x alone, replaced the compiled plan that had read 1.5x, and ran 1.05x)."""
    models = {"fp32": runner.fp32, name: finalist.runnable}
    if rival is not None:
        models[rival.name] = rival.model
    with as_eval_fn_calls(runner):
        by_shape = latency_by_shape(runner.measurer, models, runner.shapes, runner.config.repeats, warmup=0)
    ratio = weighted_ratio(ratios_to_fp32(by_shape, name), runner.shapes)
    rival_ratio = 1.0 if rival is None else weighted_ratio(ratios_to_fp32(by_shape, rival.name), runner.shapes)
    return Winner(finalist.plan, finalist.engine, finalist.runnable, accuracy, _fp32_and(by_shape, name), ratio,
                  finalist.setup_s, finalist.knobs, name, built=finalist.built), rival_ratio


def _fp32_and(by_shape: dict[str, dict[str, LatencyStats]], name: str) -> dict[str, dict[str, LatencyStats]]:
    return {shape: {"fp32": timing["fp32"], "best": timing[name]} for shape, timing in by_shape.items()}
