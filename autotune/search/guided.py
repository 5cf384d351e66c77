"""The guided candidates tried before Optuna's sampler: O(log N) evaluations.

1. seeds: the fastest predicted plan, then the uniform plans (every unit in one dtype where allowed) not
   predicted slower than a passing one; if the fastest passes, the search ends there;
2. knapsack bisection: for a budget B of predicted output noise, the knapsack plan is the fastest plan (by the
   per-unit timings) whose summed noise stays within B. Bisecting B on a log scale between the baseline (passes)
   and the fastest plan (fails) finds the passing boundary; plans repeat between budgets, so each distinct plan
   costs at most one evaluation.

The search is replayed from what the study knows each time a worker asks for its next plan, so several workers
share it: a plan another worker is running counts as a split point whose outcome is not known yet, and the
next worker bisects the interval above it, so k workers evaluate k budgets of one bisection at once; a single
worker bisects exactly as before. While the fastest plan runs, the uniform plans and the bisection go ahead as
if it fails (the usual case). Outcomes still to come only narrow the intervals, never widen one, so a worker
with no plan to take is done with this phase.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Callable

from autotune.plan import Plan, is_baseline
from autotune.search.space import SearchSpace

BUDGET_RESOLUTION = 0.01      # bisection stops when the passing and failing budgets are within 1 %
MAX_BISECTION_STEPS = 40      # each step costs an evaluation only when it reaches a plan not seen before


class Status(enum.Enum):
    NEW = "new"               # nobody has run or taken it
    RUNNING = "running"       # queued or running in some worker: its outcome is coming
    PASSED = "passed"
    FAILED = "failed"         # missed the tolerance, or its trial failed


StatusOf = Callable[[Plan], Status]   # a unit plan's status in the study


def exhaustive_order(space: SearchSpace) -> list[Plan]:
    """Every plan but all-FP32 (that is the baseline), fastest predicted first: the search of a small space."""
    lowered = (plan for plan in space.all_plans() if not is_baseline(plan))
    return sorted(lowered, key=space.predicted_ms)


class GuidedSearch:
    """The guided plans of one search space; `next_plan` says what to run next given every plan's status."""

    def __init__(self, space: SearchSpace):
        self.space = space
        self._knapsack: dict[float, Plan] = {}    # budget -> plan: the replay asks for the same budgets again

    def next_plan(self, status_of: StatusOf) -> Plan | None:
        """A plan to run now, or None when no plan is left to take (some may still be running elsewhere)."""
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
        return self._bisection(space.predicted_noise(fastest), status)

    def _bisection(self, failing: float, status: Callable[[Plan], Status]) -> Plan | None:
        """Bisects the noise budget between the baseline (0, passes) and `failing` (the fastest plan's)."""
        positive = [self.space.sensitivity[u][d] ** 2 for u, options in self.space.choices.items()
                    for d in options if self.space.sensitivity[u][d] > 0]
        if not positive or failing <= 0:
            return None
        passing, floor = 0.0, min(positive)
        running: list[float] = []          # budgets whose plans other workers are running
        for _ in range(MAX_BISECTION_STEPS):
            low = max(passing, floor)
            points = [low, *sorted(b for b in running if low < b < failing), failing]
            gaps = [(a, b) for a, b in zip(points, points[1:]) if b > a * (1 + BUDGET_RESOLUTION)]
            if not gaps:
                return None
            # The uppermost gap: a running budget is taken to pass. The lower end starts at the least noise of
            # any one module, far below the boundary, so early budgets pass; near the end it is a coin toss.
            below, above = gaps[-1]
            middle = math.sqrt(below * above)
            plan = self._knapsack_plan(middle)
            outcome = status(plan)
            if outcome is Status.NEW:
                return plan
            if outcome is Status.RUNNING:
                running.append(middle)
            elif outcome is Status.PASSED:
                passing = middle
            else:
                failing = middle
        return None

    def _knapsack_plan(self, budget: float) -> Plan:
        if budget not in self._knapsack:
            self._knapsack[budget] = self.space.knapsack_plan(budget)
        return self._knapsack[budget]
