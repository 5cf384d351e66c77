"""The guided search alone, as k workers share it: every evaluation takes one time unit and costs nothing else, so
what is left is the search's own parallel efficiency, the bound on what more workers can gain.

    .venv/bin/python benchmarks/parallel_search.py [--workers 1,2,4]

For 72 spaces (50 / 200 / 500 modules x 4 seeds x linear / convex / concave loss curves x 0 / 10 % loss noise)
prints the time to the plan the search ends with and the evaluations spent, against one worker's. The tests of
the search (tests/test_search.py) replay it the same way.
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from autotune.plan import Plan, plan_key
from autotune.search.guided import GuidedSearch, Status
from autotune.search.space import SearchSpace

Loss = Callable[[Plan], float]    # a plan's accuracy loss in tolerances (1 is the limit)


def graded_space(n: int, seed: int) -> SearchSpace:
    """n modules of varied cost and int8 / bf16 noise: the boundary is a real mix of dtypes."""
    rng = random.Random(seed)
    candidates = {f"m{i}": ["int8", "bf16", "fp32"] for i in range(n)}
    latency, sensitivity = {}, {}
    for name in candidates:
        fp32 = rng.lognormvariate(0, 0.5)
        latency[name] = {"fp32": fp32, "int8": fp32 * rng.uniform(0.3, 0.8), "bf16": fp32 * rng.uniform(0.55, 0.95)}
        int8 = rng.lognormvariate(0, 1.6)
        sensitivity[name] = {"fp32": 0.0, "int8": int8, "bf16": int8 * rng.uniform(0.1, 0.3)}
    return SearchSpace.build(candidates, sensitivity, latency)


def replay(space: SearchSpace, passes: Callable[[Plan], bool], workers: int = 1,
           loss: Loss | None = None) -> list[tuple[int, Plan]]:
    """The guided search as `workers` workers run it: (the time it ended, plan) per evaluation, in the order the
    plans were taken. `loss` is what the search is told of an evaluated plan; without it, only whether it passed."""
    search, status, losses = GuidedSearch(space), {}, {}
    running: list[tuple[int, Plan]] = []
    evaluations: list[tuple[int, Plan]] = []
    clock = 0
    while True:
        while len(running) < workers and (plan := search.next_plan(
                lambda p: status.get(plan_key(p), Status.NEW), lambda p: losses.get(plan_key(p)))) is not None:
            status[plan_key(plan)] = Status.RUNNING
            running.append((clock + 1, plan))
            evaluations.append(running[-1])
        if not running:
            return evaluations
        clock, plan = running.pop(0)      # the oldest ends first
        status[plan_key(plan)] = Status.PASSED if passes(plan) else Status.FAILED
        if loss is not None:
            losses[plan_key(plan)] = loss(plan)


def time_to_best(space: SearchSpace, evaluations: list[tuple[int, Plan]], passes: Callable[[Plan], bool]) -> int:
    """When the fastest passing plan evaluated was first done."""
    passing = [(space.predicted_ms(plan), end) for end, plan in evaluations if passes(plan)]
    best = min(ms for ms, _ in passing)
    return min(end for ms, end in passing if ms == best)


def _noise(plan: Plan, sigma: float) -> float:
    """A fixed multiplicative error per plan (lognormal, sigma): losses the noise budget does not predict."""
    return random.Random(plan_key(plan)).lognormvariate(0.0, sigma)   # seeded by the plan: the same every run


def cases():
    for n in (50, 200, 500):
        for seed in range(4):
            space = graded_space(n, seed)
            limit = space.predicted_noise(space.fastest_plan()) / 4   # the fastest plan loses ~4 tolerances
            for power in (1.0, 3.0, 0.4):
                for sigma in (0.0, 0.1):
                    def loss(plan, space=space, limit=limit, power=power, sigma=sigma):
                        return (space.predicted_noise(plan) / limit) ** power * _noise(plan, sigma)
                    yield space, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", default="1,2,4")
    counts = [int(w) for w in parser.parse_args().workers.split(",")]
    times = {w: [] for w in counts}
    evaluations = {w: [] for w in counts}
    for space, loss in cases():
        passes = lambda plan, loss=loss: loss(plan) <= 1     # noqa: E731
        alone = replay(space, passes, 1, loss)
        for workers in counts:
            shared = replay(space, passes, workers, loss)
            times[workers].append(time_to_best(space, shared, passes) / time_to_best(space, alone, passes))
            evaluations[workers].append(len(shared) / len(alone))
    print("| workers | time to the final plan vs 1 worker (mean) | evaluations vs 1 worker (mean) |\n|---|---|---|")
    for workers in counts:
        print(f"| {workers} | {statistics.mean(times[workers]):.2f} | {statistics.mean(evaluations[workers]):.2f} |")


if __name__ == "__main__":
    main()
