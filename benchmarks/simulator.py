"""A simulated workload whose accuracy and latency are KNOWN functions of the plan, so the true optimum is known.

The model is `nn.Sequential` of N tiny `nn.Linear(4, 4)`: the real backends lower it (int8 ->
`DynamicInt8Linear`, bf16 -> `CastWrapper`), the tuner runs unchanged, and `plan_of(model)` reads the plan back
from the lowered module types. Every module carries seeded random properties:

- fp32 cost (ms, log-normal) and int8 / bf16 cost ratios; a few ratios are > 1 (slower than fp32: pruning matters);
- accuracy loss per dtype, heavy-tailed (log-normal, sigma 1.6: most tiny, a few large); bf16 loses 1-10 % of
  what int8 loses. Losses are scaled so that all-int8 loses `int8_overshoot` x the tolerable loss (it fails) while
  all-bf16 passes: the optimum is a real mix of int8, bf16 and fp32.

The accuracy model is ADDITIVE: accuracy(plan) = baseline - sum of the plan's per-module losses (no interactions).
The latency model is additive too: latency(plan) = sum of the plan's per-module costs, speedup = fp32 / that.
Under those two models the fastest plan within the tolerance is a multiple-choice knapsack, solved exactly (up to
the integerisation of the losses, bounded from above by the same DP with the losses rounded down) by `oracle`.

`SimMeasurer` implements autotune's `Measurer` protocol: its per-module signals are a NOISY proxy of the truth
(sensitivity = sqrt(loss) x log-normal noise, sigma 0.3 by default; the tuner treats sensitivity^2 as additive
noise, so this is the truth with multiplicative noise), module latency = true cost x small noise; `latency()` of
whole models returns their plan's true latency x small noise. `eval_fn` sleeps a fixed emulated cost per call.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from autotune.measure import LatencyStats
from autotune.plan import plan_of as read_plan
from autotune.search.knapsack import min_cost_choice

DTYPES = ("int8", "bf16", "fp32")
WIDTH = 4


@dataclass
class SimWorkload:
    n: int
    seed: int = 0
    baseline: float = 0.90            # accuracy of the fp32 model
    tolerable_loss: float = 0.01      # relative, as TuningConfig(loss_kind="relative")
    int8_overshoot: float = 4.0       # all-int8 loses this many times the tolerable loss
    slow_fraction: float = 0.08       # share of modules whose int8 (and, separately, bf16) is slower than fp32
    eval_cost_s: float = 0.2          # emulated eval_fn cost (sleep) per call
    proxy_sigma: float = 0.3          # log-normal noise of the sensitivity proxy
    latency_noise: float = 0.01       # relative noise of whole-model latency measurements
    cost_ms: np.ndarray = field(init=False)
    ratio: dict = field(init=False)   # {dtype: per-module cost ratio vs fp32}
    loss: dict = field(init=False)    # {dtype: per-module absolute accuracy loss}

    def __post_init__(self):
        rng = np.random.default_rng(self.seed)
        n = self.n
        self.cost_ms = rng.lognormal(0.0, 0.5, n)
        int8 = rng.uniform(0.30, 0.80, n)
        bf16 = rng.uniform(0.55, 0.95, n)
        for ratios in (int8, bf16):
            slow = rng.random(n) < self.slow_fraction
            ratios[slow] = rng.uniform(1.05, 1.6, int(slow.sum()))
        self.ratio = {"fp32": np.ones(n), "int8": int8, "bf16": bf16}
        raw = rng.lognormal(0.0, 1.6, n)                       # heavy-tailed
        budget = self.tolerable_loss * self.baseline           # absolute accuracy the tolerance allows to lose
        loss8 = raw / raw.sum() * self.int8_overshoot * budget
        self.loss = {"fp32": np.zeros(n), "int8": loss8, "bf16": loss8 * rng.uniform(0.01, 0.10, n)}

    # --- the model and reading plans back -------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [str(i) for i in range(self.n)]

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(self.n))).eval()

    def example_inputs(self) -> torch.Tensor:
        return torch.ones(1, WIDTH)

    # --- the known functions of the plan ----------------------------------------------------------------------
    def _index(self, plan: dict[str, str]) -> np.ndarray:
        codes = np.zeros(self.n, dtype=np.int64)
        for name, dtype in plan.items():
            codes[int(name)] = DTYPES.index(dtype)
        return codes

    def accuracy(self, plan: dict[str, str]) -> float:
        """baseline - sum of per-module losses (additive model); modules missing from `plan` are fp32."""
        codes = self._index(plan)
        total = sum(self.loss[d][codes == k].sum() for k, d in enumerate(DTYPES))
        return float(self.baseline - total)

    def latency_ms(self, plan: dict[str, str]) -> float:
        codes = self._index(plan)
        return float(sum((self.cost_ms * self.ratio[d])[codes == k].sum() for k, d in enumerate(DTYPES)))

    @property
    def fp32_ms(self) -> float:
        return float(self.cost_ms.sum())

    def speedup(self, plan: dict[str, str]) -> float:
        return self.fp32_ms / self.latency_ms(plan)

    def passes(self, plan: dict[str, str]) -> bool:
        """The tuner's rule (relative loss <= tolerable_loss), on the known accuracy."""
        return (self.baseline - self.accuracy(plan)) / abs(self.baseline) <= self.tolerable_loss

    def uniform(self, dtype: str) -> dict[str, str]:
        return {name: dtype for name in self.names}

    # --- what the tuner sees ------------------------------------------------------------------------------------
    def eval_fn(self, model: nn.Module) -> float:
        """Sleeps the emulated cost and returns the known accuracy of the plan the model's module types spell.

        It runs the model only when nothing in it is lowered (the fp32 baseline, where the tuner captures the
        inputs eval_fn feeds the model): FBGEMM's dynamic int8 and the bf16 casts cost ~10 ms per call of these
        tiny modules on a loaded 2-core host, which would swamp the emulated eval cost at N = 500."""
        plan = plan_of(model)
        if all(dtype == "fp32" for dtype in plan.values()):
            with torch.inference_mode():
                model(self.example_inputs())
        if self.eval_cost_s:
            time.sleep(self.eval_cost_s)
        return self.accuracy(plan)

    def measurer(self, seed: int | None = None) -> SimMeasurer:
        return SimMeasurer(self, seed=self.seed + 1 if seed is None else seed)

    def oracle(self, bins: int | None = None) -> OracleResult:
        return oracle(self, bins)


def plan_of(model: nn.Module) -> dict[str, str]:
    """{module name: dtype} of a (lowered) simulator model: every child is one tunable module."""
    return read_plan(model, [name for name, _ in model.named_children()])


class SimMeasurer:
    """autotune's Measurer protocol over the simulator's known functions, with seeded noise."""

    def __init__(self, sim: SimWorkload, seed: int = 1):
        self.sim = sim
        self.rng = np.random.default_rng(seed)

    def sensitivity(self, fp32, candidates, inputs, calibration):
        sim, rng = self.sim, self.rng
        return {name: {d: 0.0 if d == "fp32" else
                       float(math.sqrt(sim.loss[d][int(name)]) * rng.lognormal(0.0, sim.proxy_sigma)) for d in dtypes}
                for name, dtypes in candidates.items()}

    def module_latency(self, fp32, candidates, inputs, calibration):
        sim, rng = self.sim, self.rng
        return {name: {d: float(sim.cost_ms[int(name)] * sim.ratio[d][int(name)] * (1 + rng.normal(0, 0.03)))
                       for d in dtypes}
                for name, dtypes in candidates.items()}

    def latency(self, models, inputs, repeats, warmup=None):
        out = {}
        for name, model in models.items():
            true = self.sim.latency_ms(plan_of(model))
            samples = true * (1 + self.rng.normal(0, self.sim.latency_noise, max(repeats, 3)))
            q1, q3 = np.percentile(samples, [25, 75])
            out[name] = LatencyStats(float(np.median(samples)), float(q3 - q1), len(samples))
        return out


@dataclass(frozen=True)
class OracleResult:
    plan: dict[str, str]
    speedup: float
    upper_bound: float   # no plan within the tolerance is faster than this (DP with losses rounded down)


def _mck(sim: SimWorkload, budget: float, bins: int, rounding) -> dict[str, str]:
    """The plan of least total latency whose loss, integerised into `bins` steps of `budget`, fits."""
    weights = {d: rounding(sim.loss[d] / budget * bins).astype(np.int64) for d in DTYPES}
    picks = min_cost_choice([[sim.cost_ms[i] * sim.ratio[d][i] for d in DTYPES] for i in range(sim.n)],
                            [[int(weights[d][i]) for d in DTYPES] for i in range(sim.n)], bins)
    return {str(i): DTYPES[pick] for i, pick in enumerate(picks)}


def oracle(sim: SimWorkload, bins: int | None = None) -> OracleResult:
    """The fastest plan within the tolerance under the known (additive) models: multiple-choice knapsack DP with
    the losses integerised into `bins` steps of the loss budget, rounded up (every plan it returns passes). The
    same DP with losses rounded down gives an upper bound on the true optimum's speedup."""
    bins = bins or max(20000, 200 * sim.n)
    budget = sim.tolerable_loss * abs(sim.baseline)
    for shrink in (1.0, 1 - 1e-9, 1 - 1e-6):      # float rounding of the pass rule: shrink until it passes
        plan = _mck(sim, budget * shrink, bins, np.ceil)
        if sim.passes(plan):
            break
    else:
        raise AssertionError("oracle plan fails the tolerance")
    bound = _mck(sim, budget, bins, np.floor)
    return OracleResult(plan, sim.speedup(plan), max(sim.speedup(bound), sim.speedup(plan)))


def brute_force(sim: SimWorkload) -> tuple[dict[str, str], float]:
    """Every plan of a tiny instance: the fastest passing plan and its speedup (for tests)."""
    import itertools
    best, best_speedup = sim.uniform("fp32"), 1.0
    for dtypes in itertools.product(DTYPES, repeat=sim.n):
        plan = dict(zip(sim.names, dtypes))
        if sim.passes(plan) and sim.speedup(plan) > best_speedup:
            best, best_speedup = plan, sim.speedup(plan)
    return best, best_speedup
