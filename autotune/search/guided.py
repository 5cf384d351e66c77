"""The guided candidates tried before Optuna's sampler: O(log N) evaluations.

1. seeds: the fastest predicted plan, then the uniform plans (every unit in one dtype where allowed) not
   predicted slower than a passing one; if the fastest passes, the search ends there;
2. knapsack bisection: for a budget B of predicted output noise, the knapsack plan is the fastest plan (by the
   per-unit timings) whose summed noise stays within B. Bisecting B on a log scale between the baseline (passes)
   and the fastest plan (fails) finds the passing boundary; plans repeat between budgets, so each distinct plan
   costs at most one evaluation.
"""
from __future__ import annotations

import math
from collections.abc import Generator

from autotune.plan import Plan, is_baseline, plan_key
from autotune.search.space import SearchSpace

# A generator of unit plans; each `yield` receives back whether that plan met the accuracy requirement.
GuidedSearch = Generator[Plan, bool, None]
BUDGET_RESOLUTION = 0.01      # bisection stops when the passing and failing budgets are within 1 %
MAX_BISECTION_STEPS = 40      # each step costs an evaluation only when it reaches a plan not seen before


def exhaustive_order(space: SearchSpace) -> list[Plan]:
    """Every plan but all-FP32 (that is the baseline), fastest predicted first: the search of a small space."""
    lowered = (plan for plan in space.all_plans() if not is_baseline(plan))
    return sorted(lowered, key=space.predicted_ms)


def knapsack_bisection(space: SearchSpace, failing_budget: float) -> GuidedSearch:
    """Bisects the noise budget between the baseline (0, passes) and `failing_budget` (fails)."""
    positive = [space.sensitivity[u][d] ** 2 for u, options in space.choices.items() for d in options
                if space.sensitivity[u][d] > 0]
    if not positive or failing_budget <= 0:
        return
    passing = 0.0
    floor = min(positive)
    results: dict[str, bool] = {}     # plans recur between budgets: each is yielded once
    for _ in range(MAX_BISECTION_STEPS):
        low = max(passing, floor)
        if failing_budget <= low * (1 + BUDGET_RESOLUTION):
            return
        middle = math.sqrt(low * failing_budget)
        plan = space.knapsack_plan(middle)
        key = plan_key(plan)
        if key not in results:
            results[key] = True if is_baseline(plan) else (yield plan)
        if results[key]:
            passing = middle
        else:
            failing_budget = middle


def guided_search(space: SearchSpace) -> GuidedSearch:
    fastest = space.fastest_plan()
    fastest_passed = is_baseline(fastest) or (yield fastest)
    best_passing_ms = space.predicted_ms(fastest) if fastest_passed else math.inf
    # A uniform plan predicted no slower than the fastest (a dtype kept by the whole-model check costs what
    # fp32 does) is still tried: predictions come from modules timed alone, the trial times the whole model.
    for plan in space.uniform_plans():
        if plan != fastest and space.predicted_ms(plan) <= best_passing_ms and (yield plan):
            best_passing_ms = min(best_passing_ms, space.predicted_ms(plan))
    if not fastest_passed:
        yield from knapsack_bisection(space, space.predicted_noise(fastest))
