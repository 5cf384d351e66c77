"""Search strategy: the pruned search space and the guided candidates tried before Optuna's sampler.

Guided phase: try the plan that is fastest by the per-module timings; if it misses the accuracy requirement,
walk back towards FP32 along the fallback path (each step moves the module with the most output error saved
per millisecond lost to its next safer dtype) and bisect for the fastest passing point: O(log N) evaluations.
What budget is left then goes, in a small space, to the remaining plans fastest-predicted first, and in a
large one to Optuna's TPE sampler around the best plans (in the tuner).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Generator, Iterator

from autotune.plan import Plan, is_baseline

# A generator of plans; each `yield` receives back whether that plan met the accuracy requirement.
GuidedSearch = Generator[Plan, bool, None]


@dataclass(frozen=True)
class SearchSpace:
    choices: dict[str, list[str]]                  # per module, fastest first; fp32 always present
    sensitivity: dict[str, dict[str, float]]       # output error with only that module lowered
    latency_ms: dict[str, dict[str, float]]        # the module alone, per dtype

    @classmethod
    def build(cls, candidates: dict[str, list[str]], sensitivity: dict[str, dict[str, float]],
              latency_ms: dict[str, dict[str, float]]) -> "SearchSpace":
        """Drops, per module, every dtype measured slower than fp32 or that broke the output (inf error)."""
        choices = {}
        for name, dtypes in candidates.items():
            times = latency_ms[name]
            kept = [d for d in dtypes if d == "fp32" or (times[d] < times["fp32"]
                                                       and sensitivity[name][d] != float("inf"))]
            choices[name] = sorted(kept, key=lambda d: (times[d], d))
        return cls(choices, sensitivity, latency_ms)

    @property
    def size(self) -> int:
        size = 1
        for options in self.choices.values():
            size *= len(options)
        return size

    def predicted_ms(self, plan: Plan) -> float:
        return sum(self.latency_ms[name][dtype] for name, dtype in plan.items())

    def all_plans(self) -> Iterator[Plan]:
        names = list(self.choices)
        for dtypes in itertools.product(*(self.choices[name] for name in names)):
            yield dict(zip(names, dtypes))

    def fastest_plan(self) -> Plan:
        return {name: options[0] for name, options in self.choices.items()}

    def _safer_step(self, name: str, current: str) -> tuple[float, str]:
        """(error saved per ms lost, next dtype) for moving module `name` one step towards FP32."""
        errors, times = self.sensitivity[name], self.latency_ms[name]
        safer = [d for d in self.choices[name] if errors[d] < errors[current]] or ["fp32"]
        target = safer[0]
        saved = errors[current] - errors[target]
        lost = max(times[target] - times[current], 1e-6)
        return saved / lost, target

    def fallback_path(self, start: Plan) -> list[Plan]:
        """Plans from `start` to all-FP32, one module moved one step safer each time."""
        current = dict(start)
        path = [dict(current)]
        while not is_baseline(current):
            steps = {name: self._safer_step(name, dtype) for name, dtype in current.items() if dtype != "fp32"}
            name = max(steps, key=lambda n: (steps[n][0], n))
            current[name] = steps[name][1]
            path.append(dict(current))
        return path


def exhaustive_order(space: SearchSpace) -> list[Plan]:
    """Every plan but all-FP32 (that is the baseline), fastest predicted first: the search of a small space."""
    lowered = (plan for plan in space.all_plans() if not is_baseline(plan))
    return sorted(lowered, key=space.predicted_ms)


def guided_search(space: SearchSpace) -> GuidedSearch:
    start = space.fastest_plan()
    if is_baseline(start):
        return
    if (yield start):
        return
    path = space.fallback_path(start)
    failing, passing = 0, len(path) - 1   # the all-FP32 end is the baseline, which passes
    while passing - failing > 1:
        middle = (failing + passing) // 2
        if (yield path[middle]):
            passing = middle
        else:
            failing = middle
