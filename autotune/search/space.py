"""The search space: units and the dtypes each may take, with the per-unit signals that predict a plan.

A unit is one module, or a group of modules that must share a dtype; the search assigns dtypes to units and
`SearchSpace.expand` turns that into a per-module plan. Noise is the squared output error of the unit lowered
alone: independent rounding errors add in variance.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from autotune.discovery import shared_dtypes, units_of
from autotune.plan import Plan, uniform_plan
from autotune.search.knapsack import min_cost_choice

KNAPSACK_BINS = 2000          # resolution of the noise budget in the knapsack


@dataclass(frozen=True)
class SearchSpace:
    choices: dict[str, list[str]]                  # per unit, fastest first; fp32 always present
    members: dict[str, list[str]]                  # per unit, its modules
    sensitivity: dict[str, dict[str, float]]       # per unit: output error with only that unit lowered
    latency_ms: dict[str, dict[str, float]]        # per unit: its modules alone, per dtype

    @classmethod
    def build(cls, candidates: dict[str, list[str]], sensitivity: dict[str, dict[str, float]],
              latency_ms: dict[str, dict[str, float]], groups: list[list[str]] = ()) -> SearchSpace:
        """Per unit: the dtypes every member takes, minus those measured slower than fp32 or with inf (or no) error;
        fastest first, fp32 ahead of a dtype that costs the same."""
        units = units_of(candidates, list(groups))
        choices, unit_error, unit_ms = {}, {}, {}
        for unit, names in units.items():
            shared = shared_dtypes(candidates, names)
            unit_ms[unit] = {d: sum(latency_ms[n][d] for n in names) for d in shared}
            # Errors of members lowered together add in variance; one not measured (its dtype was timed slower
            # than fp32 on that module: measurer.cached_signals) counts as unbounded.
            unit_error[unit] = {d: math.sqrt(sum(sensitivity[n].get(d, math.inf) ** 2 for n in names)) for d in shared}
            # A cost equal to fp32's marks a dtype kept by the whole-model check (module_latency.confirm_in_context).
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
