"""The guided candidates tried before Optuna's sampler: O(log N) evaluations, usually far fewer.

1. seeds: the fastest predicted plan, then the uniform plans (every unit in one dtype where allowed) not
   predicted slower than a passing one; if the fastest passes, the search ends there;
2. knapsack search of the boundary: for a budget B of predicted output noise, the knapsack plan is the fastest
   plan (by the per-unit timings) whose summed noise stays within B. The passing boundary lies between the
   baseline (passes) and the fastest plan (fails). The next budget is where the measured accuracy losses of the
   two ends, interpolated over their budgets, reach the tolerance (regula falsi, Illinois-safeguarded, so a
   loss that grows unevenly with noise does not stall one end); without losses it bisects on a log scale. It
   stops once the plans at the two ends are predicted within `LATENCY_RESOLUTION` of each other's time: no
   timing tells such plans apart, so an evaluation there buys nothing. Plans repeat between budgets, so each
   distinct plan costs at most one evaluation.

The search is replayed from what the study knows each time a worker asks for its next plan, so several workers
share it: a plan another worker is running counts as a split point whose outcome is not known yet, and the
next worker splits the interval above it, so k workers evaluate k budgets of one search at once; a single
worker searches exactly as alone. While the fastest plan runs, the uniform plans and the search go ahead as
if it fails (the usual case). Outcomes still to come only narrow the intervals, never widen one, so a worker
with no plan to take is done with this phase.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from autotune.plan import Plan, is_baseline
from autotune.search.space import SearchSpace

BUDGET_RESOLUTION = 0.01      # the search stops when the passing and failing budgets are within 1 %
LATENCY_RESOLUTION = 0.005    # ... or their plans' predicted times are: below what a timing tells apart
MAX_BISECTION_STEPS = 40      # each step costs an evaluation only when it reaches a plan not seen before
INTERPOLATION_MARGIN = 0.05   # an interpolated budget keeps this share of the interval from either end


class Status(enum.Enum):
    NEW = "new"               # nobody has run or taken it
    RUNNING = "running"       # queued or running in some worker: its outcome is coming
    PASSED = "passed"
    FAILED = "failed"         # missed the tolerance, or its trial failed


StatusOf = Callable[[Plan], Status]   # a unit plan's status in the study
LossOf = Callable[[Plan], "float | None"]   # an evaluated unit plan's accuracy loss over the tolerable loss


def exhaustive_order(space: SearchSpace) -> list[Plan]:
    """Every plan but all-FP32 (that is the baseline), fastest predicted first: the search of a small space."""
    lowered = (plan for plan in space.all_plans() if not is_baseline(plan))
    return sorted(lowered, key=space.predicted_ms)


def holds_a_missed_plan(plan: Plan, missed: list[Plan]) -> bool:
    """Whether `plan` holds every lowering of a plan that missed the tolerance (each of its lowered units in the same
    dtype): lowering more units only adds error, so it misses too. (Timing has no such rule: a plan predicted slower
    may still run faster in the whole model, which its trial measures.)"""
    return any(_holds(plan, other) for other in missed)


def _holds(plan: Plan, other: Plan) -> bool:
    """Whether `plan` lowers every unit `other` lowers, in the same dtype."""
    return all(plan[unit] == dtype for unit, dtype in other.items() if dtype != "fp32")


@dataclass
class _End:
    """One end of the interval the boundary lies in: a budget and its plan's loss in tolerances (None where not
    known); `weight` scales the loss's distance from the tolerance (Illinois)."""
    budget: float
    loss: float | None
    weight: float = 1.0


class GuidedSearch:
    """The guided plans of one search space; `next_plan` says what to run next given every plan's status."""

    def __init__(self, space: SearchSpace):
        self.space = space
        self._knapsack: dict[float, Plan] = {}    # budget -> plan: the replay asks for the same budgets again

    def next_plan(self, status_of: StatusOf, loss_of: LossOf = lambda plan: None) -> Plan | None:
        """A plan to run now, or None when no plan is left to take (some may still be running elsewhere).
        `loss_of` places budgets by the losses measured so far; without it the search bisects."""
        def status(plan: Plan) -> Status:
            return Status.PASSED if is_baseline(plan) else status_of(plan)

        space = self.space
        fastest = space.fastest_plan()
        fastest_status = status(fastest)
        if fastest_status is Status.NEW:
            return fastest
        best_passing_ms = space.predicted_ms(fastest) if fastest_status is Status.PASSED else math.inf
        # A uniform plan predicted no slower than the fastest (a dtype kept by the whole-model check costs what
        # fp32 does) is still tried: predictions come from modules timed alone, the trial times the whole model.
        for plan in space.uniform_plans():
            if plan == fastest or space.predicted_ms(plan) > best_passing_ms:
                continue
            uniform_status = status(plan)
            if uniform_status is Status.NEW:
                return plan
            if uniform_status is Status.PASSED:
                best_passing_ms = min(best_passing_ms, space.predicted_ms(plan))
        if fastest_status is Status.PASSED:
            return None
        return self._boundary(_End(space.predicted_noise(fastest), loss_of(fastest)), status, loss_of)

    def _boundary(self, failing: _End, status: StatusOf, loss_of: LossOf) -> Plan | None:
        """Searches the noise budget between the baseline (0, passes) and `failing` (the fastest plan's)."""
        positive = [self.space.sensitivity[u][d] ** 2 for u, options in self.space.choices.items()
                    for d in options if self.space.sensitivity[u][d] > 0]
        if not positive or failing.budget <= 0:
            return None
        passing, floor = _End(0.0, 0.0), min(positive)
        running: list[float] = []          # budgets whose plans other workers are running
        last: Status | None = None         # the outcome of the last evaluated step
        for _ in range(MAX_BISECTION_STEPS):
            low = max(passing.budget, floor)
            points = [low, *sorted(b for b in running if low < b < failing.budget), failing.budget]
            gaps = [(a, b) for a, b in zip(points, points[1:]) if self._worth_splitting(a, b)]
            if not gaps:
                return None
            # The uppermost gap: a running budget is taken to pass.
            below, above = gaps[-1]
            middle = _interpolated(below, above, passing, failing)
            plan = self._knapsack_plan(middle)
            outcome = status(plan)
            if outcome is Status.NEW:
                return plan
            if outcome is Status.RUNNING:
                running.append(middle)
                continue
            # Illinois: an end kept twice in a row weighs half as much, so the next budget moves towards it.
            reached = _End(middle, loss_of(plan))
            if outcome is Status.PASSED:
                passing, failing.weight = reached, failing.weight / 2 if last is outcome else failing.weight
            else:
                failing, passing.weight = reached, passing.weight / 2 if last is outcome else passing.weight
            last = outcome
        return None

    def _worth_splitting(self, below: float, above: float) -> bool:
        """Whether the plans at two budgets are far enough apart, in budget and in predicted time, to evaluate
        one between them."""
        if above <= below * (1 + BUDGET_RESOLUTION):
            return False
        slow_ms = self.space.predicted_ms(self._knapsack_plan(below))
        return slow_ms - self.space.predicted_ms(self._knapsack_plan(above)) > LATENCY_RESOLUTION * slow_ms

    def _knapsack_plan(self, budget: float) -> Plan:
        if budget not in self._knapsack:
            self._knapsack[budget] = self.space.knapsack_plan(budget)
        return self._knapsack[budget]


def _interpolated(below: float, above: float, passing: _End, failing: _End) -> float:
    """The budget where the loss, linear in the budget between the two ends, reaches the tolerance (loss 1),
    kept `INTERPOLATION_MARGIN` of the gap inside (below, above); the geometric middle without losses."""
    if passing.loss is None or failing.loss is None or not passing.loss <= 1 < failing.loss:
        return math.sqrt(below * above)
    short, long = (1 - passing.loss) * passing.weight, (failing.loss - 1) * failing.weight
    target = passing.budget + (failing.budget - passing.budget) * short / (short + long)
    margin = INTERPOLATION_MARGIN * (above - below)
    return min(max(target, below + margin), above - margin)
