"""The search space and the guided candidates tried before Optuna's sampler.

Units: a unit is one module, or a group of modules that must share a dtype; the search assigns dtypes to units
and `SearchSpace.expand` turns that into a per-module plan.

Guided phase, O(log N) evaluations:
1. seeds: the fastest predicted plan, then the uniform plans (every unit in one dtype where allowed) not
   predicted slower than a passing one; if the fastest passes, the search ends there;
2. knapsack bisection: for a budget B of predicted output noise, the knapsack plan is the fastest plan (by the
   per-unit timings) whose summed noise stays within B. Bisecting B on a log scale between the baseline (passes)
   and the fastest plan (fails) finds the passing boundary; plans repeat between budgets, so each distinct plan
   costs at most one evaluation.
Noise is the squared output error of the unit lowered alone: independent rounding errors add in variance.
What budget is left then goes, in a small space, to the remaining plans fastest-predicted first, and in a
large one to Optuna's TPE sampler around the best plans (in the tuner).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Generator, Iterator

import numpy as np

from autotune.errors import ConfigError
from autotune.plan import Plan, is_baseline, plan_key, uniform_plan

# A generator of unit plans; each `yield` receives back whether that plan met the accuracy requirement.
GuidedSearch = Generator[Plan, bool, None]
KNAPSACK_BINS = 2000          # resolution of the noise budget in the knapsack
BUDGET_RESOLUTION = 0.01      # bisection stops when the passing and failing budgets are within 1 %
MAX_BISECTION_STEPS = 40      # each step costs an evaluation only when it reaches a plan not seen before


def unit_name(members: list[str]) -> str:
    """`parent.{a,b,c}` for siblings, the members joined with `+` otherwise; a single module keeps its name."""
    if len(members) == 1:
        return members[0]
    parents = {name.rpartition(".")[0] for name in members}
    if len(parents) == 1:
        parent = parents.pop()
        return f"{parent + '.' if parent else ''}{{{','.join(n.rpartition('.')[2] for n in members)}}}"
    return "+".join(members)


def units_of(candidates: dict[str, list[str]], groups: list[list[str]]) -> dict[str, list[str]]:
    """{unit name: member modules} in model order; modules in no group are units of their own."""
    owner: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group:
            if name not in candidates:
                raise ConfigError(f"groups.{index}: {name!r} is not a tunable module of this model",
                                  [(f"groups.{index}", name)])
            if name in owner:
                raise ConfigError(f"groups.{index}: {name!r} is already in group {owner[name]}",
                                  [(f"groups.{index}", name)])
            owner[name] = index
    in_order = {index: [name for name in candidates if owner.get(name) == index] for index in range(len(groups))}
    units: dict[str, list[str]] = {}
    for name in candidates:
        if name not in owner:
            units[name] = [name]
        elif name == in_order[owner[name]][0]:   # a group stands where its first member does
            units[unit_name(in_order[owner[name]])] = in_order[owner[name]]
    return units


@dataclass(frozen=True)
class SearchSpace:
    choices: dict[str, list[str]]                  # per unit, fastest first; fp32 always present
    members: dict[str, list[str]]                  # per unit, its modules
    sensitivity: dict[str, dict[str, float]]       # per unit: output error with only that unit lowered
    latency_ms: dict[str, dict[str, float]]        # per unit: its modules alone, per dtype

    @classmethod
    def build(cls, candidates: dict[str, list[str]], sensitivity: dict[str, dict[str, float]],
              latency_ms: dict[str, dict[str, float]], groups: list[list[str]] = ()) -> "SearchSpace":
        """Per unit: the dtypes every member takes, minus those measured slower than fp32 or with inf error;
        fastest first, fp32 ahead of a dtype that costs the same."""
        units = units_of(candidates, list(groups))
        choices, unit_error, unit_ms = {}, {}, {}
        for unit, names in units.items():
            shared = [d for d in candidates[names[0]] if all(d in candidates[n] for n in names)]
            unit_ms[unit] = {d: sum(latency_ms[n][d] for n in names) for d in shared}
            # Errors of members lowered together add in variance.
            unit_error[unit] = {d: math.sqrt(sum(sensitivity[n][d] ** 2 for n in names)) for d in shared}
            # A cost equal to fp32's marks a dtype kept by the whole-model check (sensitivity.confirm_in_context).
            kept = [d for d in shared if d == "fp32" or (unit_ms[unit][d] <= unit_ms[unit]["fp32"]
                                                         and math.isfinite(unit_error[unit][d]))]
            choices[unit] = sorted(kept, key=lambda d: (unit_ms[unit][d], d))
        return cls(choices, units, unit_error, unit_ms)

    @property
    def size(self) -> int:
        return math.prod(len(options) for options in self.choices.values())

    def expand(self, unit_plan: Plan) -> Plan:
        """The per-module plan: every member of a unit takes the unit's dtype."""
        return {name: unit_plan[unit] for unit, names in self.members.items() for name in names}

    def predicted_ms(self, plan: Plan) -> float:
        return sum(self.latency_ms[unit][dtype] for unit, dtype in plan.items())

    def predicted_noise(self, plan: Plan) -> float:
        return sum(self.sensitivity[unit][dtype] ** 2 for unit, dtype in plan.items())

    def all_plans(self) -> Iterator[Plan]:
        units = list(self.choices)
        for dtypes in itertools.product(*(self.choices[unit] for unit in units)):
            yield dict(zip(units, dtypes))

    def fastest_plan(self) -> Plan:
        return {unit: options[0] for unit, options in self.choices.items()}

    def uniform_plans(self) -> list[Plan]:
        """For each lowered dtype, every unit that allows it in it (the rest fp32); fastest predicted first."""
        dtypes = {d for options in self.choices.values() for d in options if d != "fp32"}
        plans = [uniform_plan(self.choices, d) for d in dtypes]
        return sorted(plans, key=lambda plan: (self.predicted_ms(plan), sorted(plan.values())))

    def knapsack_plan(self, budget: float) -> Plan:
        """The fastest predicted plan whose summed noise is at most `budget` (multiple-choice knapsack)."""
        def bins(noise: float) -> int:   # rounded up, so the plan's true noise stays within the budget
            if noise == 0:
                return 0
            return math.ceil(noise / budget * KNAPSACK_BINS) if budget > 0 else KNAPSACK_BINS + 1

        units = list(self.choices)
        picks = min_cost_choice([[self.latency_ms[u][d] for d in self.choices[u]] for u in units],
                                [[bins(self.sensitivity[u][d] ** 2) for d in self.choices[u]] for u in units],
                                KNAPSACK_BINS)
        return {unit: self.choices[unit][pick] for unit, pick in zip(units, picks)}


def min_cost_choice(costs: list[list[float]], weights: list[list[int]], capacity: int) -> list[int]:
    """Multiple-choice knapsack by dynamic programming: per item, the index of the option to take so that the
    summed cost is least and the summed integer weight at most `capacity`. Every item needs an option of
    weight 0 (fp32), so some choice always fits; options heavier than `capacity` are never taken. Of options
    that tie, the first is taken."""
    # least[row, w]: least cost of the first `row` items within weight w. The choices are read back from the
    # table (an option was taken where it reproduces the cell exactly) rather than recorded per cell: recording
    # doubles the array operations, and their count, not their size, is what this costs.
    least = np.full((len(costs) + 1, capacity + 1), np.inf)
    least[0] = 0.0
    for row, (item_costs, item_weights) in enumerate(zip(costs, weights)):
        before, after = least[row], least[row + 1]
        for cost, weight in zip(item_costs, item_weights):
            if weight <= capacity:
                np.minimum(after[weight:], before[:capacity + 1 - weight] + cost, out=after[weight:])
    chosen, left = [0] * len(costs), capacity
    for row in range(len(costs) - 1, -1, -1):
        before, reached = least[row], least[row + 1][left]
        chosen[row] = next(index for index, (cost, weight) in enumerate(zip(costs[row], weights[row]))
                           if weight <= left and before[left - weight] + cost == reached)
        left -= weights[row][chosen[row]]
    return chosen


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
