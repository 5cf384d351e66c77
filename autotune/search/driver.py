"""The search policy: which plans to run, in which order, and when to stop.

Guided candidates first (autotune.search.guided); then, in a space small enough to enumerate, the remaining plans
fastest-predicted first, else Optuna's sampler. Every phase stops at the shared budget (`max_trials` evaluated
trials across all processes, `timeout`); the last two also after `patience` trials without a better passing plan,
and not at all where trials are ranked by predicted latency and the fastest predicted plan passed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from autotune.config.tuning import TuningConfig
from autotune.search.guided import GuidedSearch, Status, exhaustive_order, holds_a_missed_plan
from autotune.search.trials import TrialRunner, fail_stale_trials

EXHAUSTIVE_LIMIT = 256  # spaces this small are enumerated instead of sampled (TPE would mostly repeat plans)
TIMEOUT_REACHED = "timeout reached"
# With trial_timing: predicted, a passing trial's latency is its plan's predicted one: no plan ranks ahead of the
# fastest predicted, so once it passes every further trial is an eval_fn call that cannot win the search (on four
# unseen models and the MNIST demo, the 8 patience trials after it never won the finalists' race either).
FASTEST_PASSED = ("the fastest predicted plan passed: with trial_timing: predicted no other plan ranks faster; the "
                  "finalists' race times it against the uniform plans")
log = logging.getLogger("autotune")


@dataclass
class Budget:
    """What the search may still spend: evaluations (all processes' together) and time (no trial starts that the
    study's longest trial so far, or its baseline's eval_fn call, says would end past `deadline`), unless told
    to stop."""
    max_trials: int
    deadline: float        # time.monotonic() after which no trial starts
    should_stop: Callable[[], str | None] | None = None    # a reason to stop now (e.g. the job was cancelled)

    def left(self, runner: TrialRunner) -> bool:
        return self.spent(runner) is None

    def spent(self, runner: TrialRunner) -> str | None:
        """Why nothing is left, or None."""
        # Every worker's evaluations as of the runner's last read of the study, and the trials queued or running
        # then, each an evaluation to come: counted only once ended, k workers each started one more at the last
        # step (and a dead worker's plan, queued again, ran after the stop), going up to k - 1 past max_trials.
        if runner.evaluated + runner.in_flight >= self.max_trials:
            if runner.evaluated > self.max_trials:   # a study resumed with a smaller max_trials than it holds
                return f"the study holds {runner.evaluated} evaluated trials, past max_trials ({self.max_trials})"
            return f"max_trials ({self.max_trials}) evaluated trials reached"
        # A trial started where one as long as the longest so far would end past the deadline ran on past it (a
        # passing trial is timed too: a BERT-base's took 93 s where failing ones took 2-12 s): on a BERT-base, 88 s
        # into the quarter of the timeout kept for the compiling engines, which then built nothing.
        if time.monotonic() + runner.trial_s >= self.deadline:
            return TIMEOUT_REACHED
        return self.should_stop() if self.should_stop is not None else None


@dataclass
class Patience:
    """Evaluated trials since the study's best passing plan last got faster, every worker's together
    (storage.study.stale_trials), as of the runner's last read of the study. Trials other workers are running
    count as stale already: most are, and k workers would otherwise start k - 1 trials past the patience.
    Ranked by predicted latency (`ranked_by_prediction`), it is spent at once when the fastest predicted plan has
    passed, whichever worker ran it: no later trial can rank ahead of it."""
    limit: int
    runner: TrialRunner
    ranked_by_prediction: bool = False

    @property
    def spent(self) -> bool:
        return self.fastest_passed or self.runner.stale + self.runner.unguided_in_flight >= self.limit

    @property
    def fastest_plan_passed(self) -> bool:
        """Whether the fastest predicted plan passed, as of the runner's last read."""
        return self.runner.status_of(self.runner.space.fastest_plan()) is Status.PASSED

    @property
    def fastest_passed(self) -> bool:
        """Ranked by predicted latency, whether the fastest predicted plan passed. (A worker ending its guided phase
        while another runs that plan starts trials, and stops at the next read.)"""
        return self.ranked_by_prediction and self.fastest_plan_passed

    def reason(self) -> str:
        if self.fastest_passed:
            return FASTEST_PASSED
        return f"patience: {self.runner.stale} evaluated trials without a faster passing plan"


def run_search(runner: TrialRunner, config: TuningConfig, deadline: float,
               should_stop: Callable[[], str | None] | None = None) -> str:
    """Runs trials until the budget or patience is spent.

    Args:
        runner: runs plans as trials of the study.
        config: max_trials and patience.
        deadline: time.monotonic() after which no new trial starts.
        should_stop: asked before each trial; a reason it returns stops the search.
    Returns:
        Why the search stopped, in words.
    """
    budget = Budget(config.max_trials, deadline, should_stop)
    patience = Patience(config.patience, runner, ranked_by_prediction=config.trial_timing == "predicted")
    run_guided(runner, budget)
    if patience.fastest_plan_passed:
        if patience.ranked_by_prediction:
            return FASTEST_PASSED
        log.info("the fastest predicted plan passed: the search goes on until %d trials (patience) find no plan "
                 "running faster timed in the whole model; trial_timing: predicted would end it here", config.patience)
    if runner.space.size <= EXHAUSTIVE_LIMIT:
        return run_exhaustive(runner, budget, patience)
    return run_sampler(runner, budget, patience)


def run_guided(runner: TrialRunner, budget: Budget) -> None:
    """The guided plans, shared by every worker of the study: each takes the next plan no one has taken."""
    search = GuidedSearch(runner.space)

    def choose() -> bool:     # under the study's turn: one worker at a time chooses, queues and starts
        plan = search.next_plan(runner.status_of, runner.tolerances_lost) if budget.left(runner) else None
        if plan is not None:
            runner.queue(plan, "guided")
        return plan is not None

    # A dead worker's plan is queued again before the turn: it runs first, as the oldest queued trial.
    while True:
        fail_stale_trials(runner.study, runner.config.grace_period)
        if runner.start_next(choose, queued_only=True) is None:
            return


def run_exhaustive(runner: TrialRunner, budget: Budget, patience: Patience) -> str:
    """The plans of a small space not run yet, fastest predicted first, but for those holding every lowering of a
    plan that missed the tolerance (guided.holds_a_missed_plan): patience and budget go to plans that may pass."""
    order = exhaustive_order(runner.space)
    plans = iter(order)
    left_out = 0
    stopped: list[str] = []

    def choose() -> bool:
        nonlocal left_out
        if not budget.left(runner) or patience.spent:
            stopped.append(budget.spent(runner) or patience.reason())
            return False
        if runner.waiting:    # a dead worker's plan, queued again, runs first
            return True
        missed = [plan for plan in order if runner.missed(plan)]
        for plan in plans:    # a plan another worker evaluated, or has queued or running, is theirs
            if runner.status_of(plan) is not Status.NEW:
                continue
            if holds_a_missed_plan(plan, missed):
                left_out += 1
                continue
            runner.queue(plan, "exhaustive")
            return True
        return False

    while runner.start_next(choose, queued_only=True) is not None:
        pass
    if left_out:
        log.info("the exhaustive search left out %d plan(s), each holding every lowering of a plan that missed",
                 left_out)
    if stopped:
        return stopped[0]
    if runner.space.size == 1:   # fp32 alone: the signals pruned every lower dtype of every module
        return ("no plan to try but fp32: every module's lower dtypes were pruned, as slower than fp32 or as losing "
                "too much alone (`autotune show` lists each module's figures); only the finalists' whole-model plans, "
                "one dtype throughout, may still be built and raced")
    if budget.spent(runner) or patience.spent:
        return budget.spent(runner) or patience.reason()
    # A few plans where max_trials allowed more read as a bug unless the pruning is named.
    pruned = (f"{runner.space.size} in all: the dtypes left to each module once the signals pruned those slower than "
              "fp32 or losing too much alone; `autotune show` lists them")
    if left_out:
        return (f"every plan of the space was tried or left out ({pruned}; {left_out} left out, each holding every "
                "lowering of a plan that missed)")
    return f"every plan of the space was tried ({pruned})"


def run_sampler(runner: TrialRunner, budget: Budget, patience: Patience) -> str:
    """Trials Optuna's sampler proposes; a proposal already evaluated costs no eval_fn call, but too many in a row
    (the sampler keeps returning to known plans) end the search too."""
    duplicates = 0

    def choose() -> bool:
        return budget.left(runner) and not patience.spent and duplicates < 3 * patience.limit

    while trial := runner.start_next(choose):
        duplicates = duplicates + 1 if trial.user_attrs.get("duplicate") else 0
    if duplicates >= 3 * patience.limit:
        return f"the sampler proposed {duplicates} evaluated plans in a row"
    return budget.spent(runner) or patience.reason()
