"""A killed `autotune tune` resumes where it stopped: SIGKILL mid-study, run the same command again, compare.

The workload (`resume_workload.py`) has one clear answer whatever the latency noise: two of five Linear layers
are wrecked by int8, so the only passing plans keep them fp32, and the fastest puts the other three in int8.
Its eval_fn sleeps, so the kill lands while a trial is evaluating, and logs every call it completes
(`worker_workload.py`), so evaluations are counted from eval_fn's side. The heartbeat is short here (1 s, grace
2 s) and the resumed run starts after the grace period: the killed trial must then be FAILED and its plan
retried. Every wait is bounded.
"""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import resume_workload
import worker_workload
from optuna.trial import TrialState

TESTS_DIR = Path(__file__).parent
WAIT_S = 120
MAX_TRIALS = 6
HEARTBEAT_S, GRACE_S = 1, 2


def write_config(tmp_path: Path, study_name: str = "resume") -> Path:
    log = tmp_path / f"{study_name}-evals.log"
    return resume_workload.write_config(
        tmp_path, study_name, {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log),
                                                                                    "delay_s": 1.2}},
        max_trials=MAX_TRIALS, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
    return env


def tune_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "autotune", "tune", str(config), "-v", *extra]


def study_exists(db: Path, name: str) -> bool:
    """Read-only check, so the poller never races the tuner creating the storage's tables."""
    if not db.is_file():
        return False
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute("SELECT count(*) FROM studies WHERE study_name = ?", (name,)).fetchone()[0] > 0
    except sqlite3.Error:
        return False


def evaluated_complete(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("evaluated")]


def plan_of(trial: optuna.trial.FrozenTrial) -> tuple:
    return tuple(sorted(trial.params.items()))


def output_of(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.is_file() else ""


def kill_mid_trial(config: Path, tmp_path: Path, study_name: str) -> int:
    """Starts the tuner; SIGKILLs it once 2+ evaluated trials are COMPLETE and another is inside eval_fn. Returns
    the killed process's id."""
    db, log = tmp_path / "s.db", tmp_path / "run1.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(tune_command(config), cwd=tmp_path, env=cli_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        study = None
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tuner exited ({proc.returncode}) before it could be killed:\n{output_of(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no trial in flight after 2 completed ones within {WAIT_S} s:\n{output_of(log)}")
            if study is None and study_exists(db, study_name):
                study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{db}")
            if study is not None:
                trials = study.get_trials(deepcopy=False)
                done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated")]
                # A trial claims its plan ("plan_key", written at once) just before eval_fn, which sleeps 1.2 s:
                # the kill lands inside it.
                in_eval = [t for t in trials if t.state == TrialState.RUNNING and "plan_key" in t.user_attrs]
                if len(done) >= 2 and in_eval:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.1)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        return proc.pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def run_to_end(config: Path, tmp_path: Path, log_name: str, *extra: str) -> str:
    try:
        done = subprocess.run(tune_command(config, *extra), cwd=tmp_path, env=cli_env(), capture_output=True,
                              text=True, timeout=WAIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"`autotune tune {' '.join(extra)}` did not finish in {WAIT_S} s:\n{exc.stdout}\n{exc.stderr}")
    (tmp_path / log_name).write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


def test_killed_run_resumes_where_it_stopped(tmp_path):
    config = write_config(tmp_path)
    storage = f"sqlite:///{tmp_path}/s.db"

    killed_pid = kill_mid_trial(config, tmp_path, "resume")
    # The process is dead: what the storage holds now is exactly what it left behind.
    killed = optuna.load_study(study_name="resume", storage=storage)
    before = {t.number: (t.params, t.values) for t in evaluated_complete(killed)}
    running = killed.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    assert len(before) >= 2 and len(running) == 1, [(t.number, t.state.name) for t in killed.trials]
    interrupted = running[0]
    assert "autotune.best" not in killed.user_attrs

    time.sleep(GRACE_S + HEARTBEAT_S)   # the killed trial's last heartbeat is now older than the grace period
    output = run_to_end(config, tmp_path, "run2.log")
    assert re.search(rf"resuming after {len(before)} evaluated trials?\b", output), output

    resumed = optuna.load_study(study_name="resume", storage=storage)
    trials = {t.number: t for t in resumed.trials}
    for number, (params, values) in before.items():   # what finished before the kill is kept as it was
        assert trials[number].state == TrialState.COMPLETE, number
        assert (trials[number].params, trials[number].values) == (params, values), number
    # The interrupted trial is not counted as finished: the heartbeat check failed it (no reason of its own) ...
    assert trials[interrupted.number].state == TrialState.FAIL
    assert "fail_reason" not in trials[interrupted.number].user_attrs
    assert trials[interrupted.number].params == interrupted.params
    # ... and RetryHeartbeatStaleTrialCallback queued its plan again, which the resumed run evaluated to its end.
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == interrupted.number]
    assert len(retries) == 1 and retries[0].params == interrupted.params
    assert retries[0].state == TrialState.COMPLETE and retries[0].user_attrs.get("evaluated")
    # Where it ran once the search had stopped, the log says why ("search stopped: patience", then it ran, unsaid).
    retried_at, stopped_at = output.find(f"trial {retries[0].number} ["), output.find("search stopped:")
    assert retried_at != -1, output
    assert (stopped_at == -1 or retried_at < stopped_at or "a plan queued again when its trial stopped mid-run is "
            "tried, the search stopped or not" in output[stopped_at:retried_at]), output

    complete = evaluated_complete(resumed)
    plans = [plan_of(t) for t in complete]
    assert len(plans) == len(set(plans)), f"a plan was evaluated twice: {sorted(t.number for t in complete)}"
    assert len(complete) > len(before), "the resumed run evaluated nothing new"
    assert len(complete) <= MAX_TRIALS
    assert plan_of(interrupted) in plans
    # Counted from eval_fn's own log: every call was one trial's evaluation, in either process.
    worker_workload.assert_each_call_is_a_trials_evaluation(tmp_path / "resume-evals.log", resumed, {killed_pid})
    best = resumed.user_attrs.get("autotune.best")
    assert best is not None, "the resumed run recorded no best plan"

    # A clean, uninterrupted run of the same config (same seed) reaches the same plan.
    run_to_end(write_config(tmp_path, "clean"), tmp_path, "clean.log")
    clean = optuna.load_study(study_name="clean", storage=storage)
    worker_workload.assert_each_call_is_a_trials_evaluation(tmp_path / "clean-evals.log", clean, set())
    assert clean.user_attrs["autotune.best"]["plan"] == best["plan"] == resume_workload.expected_plan()

    print(f"\nkilled with {len(before)} trials complete (trial {interrupted.number} interrupted); "
          f"{len(complete)} complete after resume, interrupted trial {trials[interrupted.number].state.name}, "
          f"retried as trial {retries[0].number}; clean run {len(evaluated_complete(clean))} complete; "
          f"best plan {best['plan']}")
