"""The finalists' re-evaluations for the win: one eval_fn call per numerics, shared by the finalists' building
(finalists.py: a finalist judged before the others are built) and the winner's choice (winner.py)."""
from __future__ import annotations

import logging

import torch

from autotune.config.tuning import TuningConfig
from autotune.engines import KNOBS, get_engine
from autotune.errors import describe
from autotune.plan import low_dtype, plan_key
from autotune.search.finalist_plans import Finalist
from autotune.search.scores import scored
from autotune.search.trials import Outcome, TrialRunner
from autotune.storage import study as studies

log = logging.getLogger("autotune")

RECOMPILES = 4     # compiles a finalist's evaluation is given time for beyond trial_timeout (see eval_timeout)


class Verdicts:
    """The finalists' re-evaluations for the win, one eval_fn call per numerics (`numerics`), each finalist's
    outcome kept on the study as it goes (`finalist_evaluated`)."""

    def __init__(self, runner: TrialRunner):
        self.runner = runner
        self.rejected: dict[tuple, str] = {}   # numerics of a finalist that missed or failed -> its name
        self.passed: dict[tuple, float] = {}   # numerics of a finalist that passed -> its score
        self.outcomes: dict[str, str] = {}     # finalist -> how its re-evaluation went
        # (engine, low dtype, knobs) of an engine running the model outside the plan low too -> the least tolerances
        # its finalists lost beyond their own trials', and whose that was
        self.beyond_trial: dict[tuple, tuple[float, str]] = {}

    def note(self, name: str, outcome: str) -> None:
        self.outcomes[name] = outcome
        studies.set_attr(self.runner.study, "finalist_evaluated", self.outcomes)

    def add(self, name: str, more: str) -> None:
        """Adds to the outcome of a finalist that passed what its timing on its own showed."""
        self.note(name, f"{self.outcomes.get(name, 'passed as its twin did')}; {more}")

    def passing_score(self, name: str, finalist: Finalist) -> float | None:
        """The finalist's score where it passes: evaluated now, as it runs (compiled where its engine compiles:
        the score reported), or its twin's. None where it or a twin missed, or eval_fn failed (logged)."""
        key = numerics(finalist)
        if self.rejected.get(key) == name:   # judged already, as the finalists were built
            return None
        if key in self.rejected:
            log.info("%s is not evaluated: its model computes what %s's did", name, self.rejected[key])
            self.note(name, f"not evaluated: its model computes what {self.rejected[key]}'s did")
            return None
        if (lowered := _lowering_more(finalist)) and (under := self.rejected.get(numerics(finalist, lowered))):
            log.info("%s is not evaluated: it computes what %s's did with %s on top, lower in precision still",
                     name, under, " ".join(f"+{knob}" for knob in lowered))
            self.note(name, f"not evaluated: it computes what {under}'s did, lower in precision still")
            return None
        if key in self.passed:   # a twin of one that passed, then ran no faster timed again
            return self.passed[key]
        if (why := self._predicted_to_miss(finalist)) is not None:
            log.info("%s is not evaluated: %s", name, why)
            self.note(name, f"not evaluated: {why}")
            return None
        self.rejected[key] = name    # until it passes
        self.runner.eval_calls += 1
        try:
            accuracy = scored(self.runner.eval_fn, finalist.runnable, eval_timeout(self.runner.config, finalist))
        except Exception as exc:  # the user's code; the trials are saved, so try the next finalist
            log.warning("%s: re-evaluation failed (%s); trying the next", name, describe(exc))
            self.note(name, f"eval_fn failed: {describe(exc)}")
            return None
        config, baseline = self.runner.config, self.runner.baseline
        loss, passes = config.accuracy_loss(baseline, accuracy), config.passes(baseline, accuracy)
        self.note(name, f"{'passed' if passes else 'missed'}: score {accuracy:.6g}, loss {loss:.4g}")
        self._scored_twice(name, finalist, loss)
        self._note_beyond_trial(name, finalist, loss)
        if not passes:
            log.warning("%s missed the requirement when evaluated for the win (score %.6g, a loss of %.4g where "
                        "%.4g is tolerable); trying the next", name, accuracy, loss, config.tolerable_loss)
            return None
        del self.rejected[key]
        self.passed[key] = accuracy
        return accuracy

    def _predicted_to_miss(self, finalist: Finalist) -> str | None:
        """Why `finalist` would miss, where its engine runs the model outside the plan in the plan's low dtype too
        (lowp): one of that engine's finalists (same dtype and knobs) lost beyond its own trial's loss at least what
        this one's trial leaves of the tolerance. That part of the model is the same in each such finalist, so what
        it adds to a trial's loss is much the same: on BitNet, trial 9 in lowp lost 1.95 tolerances where its trial
        had lost 0.95, and trials 8 and 7, whose trials had lost 0.98 and 0.93, are not evaluated (Nemotron: 2.00
        from 0.85; on Cohere three lowp finalists of passing trials missed by 1.6-1.8, an eval_fn call each)."""
        known = self.beyond_trial.get(_beyond_trial_key(finalist))
        trial = self._trial(finalist)
        if known is None or trial is None or trial.tolerances_lost is None:
            return None
        beyond, whose = known
        if trial.tolerances_lost + beyond <= 1:
            return None
        return (f"its trial lost {trial.tolerances_lost:.2f} tolerances, and {whose} lost {beyond:.2f} more than its "
                f"own trial (its engine runs the model outside the plan in "
                f"{low_dtype(finalist.plan)} too)")

    def _note_beyond_trial(self, name: str, finalist: Finalist, loss: float) -> None:
        """Keeps the least that an evaluated finalist of an engine lowering the model outside the plan lost beyond
        its own trial's loss, in tolerances (_predicted_to_miss)."""
        trial = self._trial(finalist)
        tolerable = self.runner.config.tolerable_loss
        if (not get_engine(finalist.engine).lowers_unplanned or trial is None or trial.tolerances_lost is None
                or tolerable <= 0):
            return
        key, beyond = _beyond_trial_key(finalist), loss / tolerable - trial.tolerances_lost
        if key not in self.beyond_trial or beyond < self.beyond_trial[key][0]:
            self.beyond_trial[key] = (beyond, name)

    def _trial(self, finalist: Finalist) -> Outcome | None:
        """The outcome of the finalist's plan as a trial, eagerly; None where it was no trial."""
        return self.runner.outcomes.get(plan_key(finalist.plan))

    def missed(self, finalist: Finalist) -> bool:
        """Whether `finalist`, or a twin computing what it does, was evaluated and missed (or eval_fn failed)."""
        return numerics(finalist) in self.rejected

    def _scored_twice(self, name: str, finalist: Finalist, loss: float) -> None:
        """Warns where the model its trial scored, scored again now, lost otherwise by more than the tolerance: an
        eval_fn left with dropout on or sampling at random (a plan lost -0.01 in its trial, 0.08 here) makes every
        pass and fail chance."""
        trial = self._trial(finalist)
        if (trial is None or finalist.engine != "eager" or finalist.knobs
                or abs(loss - trial.loss) <= self.runner.config.tolerable_loss):
            return
        log.warning("eval_fn scored %s's model at a loss of %.4g where its trial scored the same model at %.4g, "
                    "more apart than the %.4g tolerated: is eval_fn random (dropout on, data sampled without a "
                    "seed)? Its passes and fails are chance then", name, loss, trial.loss,
                    self.runner.config.tolerable_loss)


def eval_timeout(config: TuningConfig, finalist: Finalist) -> float | None:
    """`trial_timeout` for a finalist's evaluation, plus room to compile it again RECOMPILES times: a compiled model
    meets the eval_fn's batch sizes and grad mode there for the first time (a 30 ms eval_fn took a compiled MLP-Mixer
    30 s), and a trial's timeout threw every compiled winner away."""
    if config.trial_timeout is None:
        return None
    return config.trial_timeout + (RECOMPILES * finalist.setup_s if finalist.engine != "eager" else 0.0)


def numerics(finalist: Finalist, without: tuple[str, ...] = ()) -> tuple:
    """Finalists with equal keys score alike, to the rounding compiling changes: their `built` models are one
    plan built by one build method (the search itself judged plans eagerly) with the same knobs, but for knobs that
    keep every value (channels_last: a MobileNet's int8 finalist and its channels_last twin each cost an eval_fn
    call to miss by the same score). `without`: the key of the finalist's model without those knobs."""
    changing = tuple(name for name in finalist.knobs if not KNOBS[name].keeps_values and name not in without)
    return type(get_engine(finalist.engine)).build, plan_key(finalist.plan), changing, _compiled_in_half(finalist)


def _beyond_trial_key(finalist: Finalist) -> tuple:
    return finalist.engine, low_dtype(finalist.plan), finalist.knobs


def _lowering_more(finalist: Finalist) -> tuple[str, ...]:
    """The finalist's knobs that run its model's matmuls in a lower dtype (autocast): where its model without them
    missed, it misses too, as the search assumes of a plan lowering more modules. On a U-Net, uniform int8 in the
    inductor engine missed by 4 tolerances, and its autocast twin then cost an eval_fn call to miss by as much."""
    return tuple(name for name in finalist.knobs if KNOBS[name].runs_in(finalist.built) is not None)


def _compiled_in_half(finalist: Finalist) -> bool:
    """Whether `finalist` is compiled and computes in bf16 / fp16: compiling such a model rounds otherwise than
    running it eagerly (inductor keeps fused intermediates in fp32), so it is no twin of its eager plan: a bf16
    GPT-2's eager plan, which had passed its trial, was not evaluated because its compiled twin missed."""
    half = (torch.bfloat16, torch.float16)
    return finalist.engine != "eager" and (any(dtype in ("bf16", "fp16") for dtype in finalist.plan.values())
                                           or any(p.dtype in half for p in finalist.built.parameters()))
