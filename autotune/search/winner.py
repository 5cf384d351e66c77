"""The verified winner: the best passing plans re-timed together against fp32, the fastest re-evaluated once."""
from __future__ import annotations

import logging

from torch import nn

from autotune.clone import clone
from autotune.measure.latency import LatencyStats
from autotune.plan import Plan, apply_plan, is_baseline, plan_key
from autotune.search.trials import TrialRunner, score_of
from autotune.storage import study as studies
from autotune.timeout import call_with_timeout

log = logging.getLogger("autotune")


def verified_winner(runner: TrialRunner) -> tuple[Plan, nn.Module, float, dict[str, LatencyStats]]:
    """Re-times the best passing plans interleaved with fp32 and re-evaluates the fastest; fp32 if none holds.

    The finalists are the three fastest passing trials and the fastest passing uniform plan, so the winner is
    never slower than the best uniform dtype in that timing (trial timings on a noisy host can rank them wrong).

    Returns:
        (plan, its model, its accuracy, timings by name with "fp32" and "best").
    """
    config = runner.config
    fp32_plan = runner.space.expand({unit: "fp32" for unit in runner.space.choices})
    passing = studies.passing_trials(runner.study)
    uniform = {plan_key(runner.space.expand(plan)) for plan in runner.space.uniform_plans()}
    best_uniform = [t for t in passing if studies.trial_plan_key(t) in uniform][:1]
    finalists = {f"trial {t.number}": plan for t in passing[:3] + best_uniform
                 if not is_baseline(plan := studies.trial_plan(t))}
    models = {name: apply_plan(runner.fp32, plan, runner.calibration, runner.variants)
              for name, plan in finalists.items()}
    timing = runner.measurer.latency({"fp32": runner.fp32, **models}, runner.inputs, 2 * config.repeats)
    for name in sorted(models, key=lambda n: timing[n].median_ms):
        if timing[name].median_ms >= timing["fp32"].median_ms:
            break
        runner.eval_calls += 1
        try:
            accuracy = score_of(call_with_timeout(runner.eval_fn, clone(models[name]), config.trial_timeout))
        except Exception as exc:  # the user's code; the trials are saved, so try the next finalist
            log.warning("%s: re-evaluation failed (%s: %s); trying the next", name, type(exc).__name__, exc)
            continue
        if config.passes(runner.baseline, accuracy):
            return finalists[name], models[name], accuracy, timing | {"best": timing[name]}
        log.warning("%s passed before but missed the requirement on re-evaluation (%.4f); trying the next",
                    name, accuracy)
    log.warning("no lowered plan both met the accuracy requirement and ran faster than fp32; keeping fp32")
    return fp32_plan, clone(runner.fp32), runner.baseline, timing | {"best": timing["fp32"]}
