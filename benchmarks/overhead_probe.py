"""Where autotune's own time goes on the simulator (no eval cost), per N: seconds outside eval_fn and
measurement per eval_fn call, and what share that would be of a search whose eval_fn takes `--eval-s`.

    .venv/bin/python benchmarks/overhead_probe.py [--sizes 50,200,500] [--max-trials 40] [--eval-s 30]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from simulator import SimWorkload  # noqa: E402
from strategies import run_autotune  # noqa: E402


def probe(n: int, max_trials: int) -> dict:
    from autotune import MixedPrecisionConfig, TuningConfig

    sim = SimWorkload(n, eval_cost_s=0.0)
    with tempfile.TemporaryDirectory() as folder:
        config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                              tolerable_loss=0.01, max_trials=max_trials, engines=["eager"],   # simulated timing
                              storage=f"sqlite:///{folder}/probe.db", study_name=f"probe-{n}")
        started = time.perf_counter()
        found, _, _ = run_autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), sim.measurer())
        wall = time.perf_counter() - started
    e = found.extra
    return {"n": n, "calls": found.eval_calls, "reached_at": found.reached_at,
            "pct_oracle": 100 * sim.speedup(found.plan) / sim.oracle().speedup, "wall_s": wall,
            "overhead_s": e["overhead_s"], "per_call_s": e["overhead_s"] / found.eval_calls,
            "apply_s": e["apply_plan_s"], "knapsack_s": e["knapsack_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="50,200,500")
    parser.add_argument("--max-trials", type=int, default=40)
    parser.add_argument("--eval-s", type=float, default=30.0, help="an eval_fn cost to express the overhead in")
    args = parser.parse_args()
    print(f"| N | eval calls (to final / total) | % of oracle | overhead s | s per eval call | share at "
          f"{args.eval_s:g} s/eval | apply_plan s | knapsack s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in map(int, args.sizes.split(",")):
        r = probe(n, args.max_trials)
        share = 100 * r["per_call_s"] / (r["per_call_s"] + args.eval_s)
        print(f"| {n} | {r['reached_at']} / {r['calls']} | {r['pct_oracle']:.1f} | {r['overhead_s']:.1f} | "
              f"{r['per_call_s']:.3f} | {share:.1f} % | {r['apply_s']:.1f} | {r['knapsack_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
