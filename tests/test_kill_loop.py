"""Crash safety: `autotune tune` is SIGKILLed 20 times mid-trial and resumed by the same command each time.

Each run is killed at a random moment of its trials: once one of its trials is evaluating (the study shows it
RUNNING, marked by this process, its plan claimed), after a random further delay of up to about two trials. After
each kill, every trial that had finished is still there, unchanged, and the trial the kill interrupted is noted.
At the end: most kills interrupted a trial; each interrupted trial is FAILED (by the heartbeat check, not left
RUNNING, with no reason of its own) and its plan evaluated to its end later; every eval_fn call that returned
was one trial's evaluation (counted from eval_fn's own log, `worker_workload.py`); the study holds no trial the
kills do not account for; and the answer an uninterrupted run finds (`resume_workload.expected_plan()`, the
fastest plan that keeps the sensitive layers fp32) was evaluated and passed, and the winner keeps those layers
fp32. Which passing plan wins is decided by timing: with the 24 trials this test spends, the exhaustive phase
also evaluates plans one int8 layer short of the answer, and on an AVX2 host, where FBGEMM's int8 Linear runs
at about 0.7 of fp32, one layer is a 6 % difference that 3 timing rounds per trial can rank either way. The
heartbeat is short here (1 s, grace 2 s) so that a restarted
process finds the killed trial stale at its start or within its first trials.
"""
from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import optuna
import pytest
import resume_workload
import worker_workload
from optuna.trial import TrialState
from test_resume_kill import WAIT_S, cli_env, output_of, run_to_end, study_exists, tune_command

from autotune.plan import plan_key
from autotune.storage.study import evaluated_trials, trial_plan

KILLS = 20
MAX_TRIALS = 24        # more than the kills let finish, so every run has trials left to be killed in
EVAL_S = 0.5
SPREAD_S = 1.5         # the kill comes up to this long after the run's first trial started evaluating
MIN_INTERRUPTED = 15   # kills that must land inside a trial (between trials there is little time to land in)


def write_config(tmp_path: Path) -> Path:
    return resume_workload.write_config(
        tmp_path, "kills",
        {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(tmp_path / "evals.log"),
                                                              "delay_s": EVAL_S}},
        max_trials=MAX_TRIALS, patience=100, repeats=3, heartbeat_interval=1, grace_period=2)


def finished(study: optuna.Study) -> dict[int, tuple]:
    """{trial number: (params, values, state)} of every finished trial, read with Optuna alone."""
    return {t.number: (t.params, t.values, t.state) for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.FAIL)}


def running_in(study: optuna.Study, pid: int) -> list[optuna.trial.FrozenTrial]:
    """The trials process `pid` is running (or was, if it is dead): RUNNING, marked by that process."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if worker_workload.runner_pid(t) == pid]


def kill_during_a_trial(config: Path, tmp_path: Path, delay_s: float, log: Path) -> tuple[int, list[int]]:
    """Starts the tuner, waits until one of its trials is evaluating, waits `delay_s` more, SIGKILLs it.
    Returns the process id and the trials it left RUNNING: those the kill interrupted."""
    db = tmp_path / "s.db"
    with open(log, "w") as out:
        proc = subprocess.Popen(tune_command(config), cwd=tmp_path, env=cli_env(), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        study = None
        while study is None or not [t for t in running_in(study, proc.pid) if "plan_key" in t.user_attrs]:
            if proc.poll() is not None:
                pytest.fail(f"tuner exited ({proc.returncode}) before a trial of its own started:\n{output_of(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no trial of its own in flight within {WAIT_S} s:\n{output_of(log)}")
            if study is None and study_exists(db, "kills"):
                study = optuna.load_study(study_name="kills", storage=f"sqlite:///{db}")
            time.sleep(0.05)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL, f"the run ended before the kill:\n{output_of(log)}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return proc.pid, [t.number for t in running_in(study, proc.pid)]


def test_twenty_kills_mid_trial_lose_nothing_and_reach_the_uninterrupted_answer(tmp_path):
    config = write_config(tmp_path)
    storage = f"sqlite:///{tmp_path}/s.db"
    rng = random.Random(20)
    delays = [rng.uniform(0, SPREAD_S) for _ in range(KILLS)]
    kept: dict[int, tuple] = {}
    killed: set[int] = set()
    interrupted: list[int] = []
    for index, delay in enumerate(delays):
        pid, left_running = kill_during_a_trial(config, tmp_path, delay, tmp_path / f"run{index}.log")
        killed.add(pid)
        assert len(left_running) <= 1, f"process {pid} was running trials {left_running} at once"
        interrupted += left_running
        now = finished(optuna.load_study(study_name="kills", storage=storage))
        for number, trial in kept.items():
            assert now.get(number) == trial, f"trial {number} changed or vanished after kill {index}"
        kept = now

    run_to_end(config, tmp_path, "final.log")
    study = optuna.load_study(study_name="kills", storage=storage)
    trials = {t.number: t for t in study.get_trials()}
    for number, (params, values, state) in kept.items():
        assert (trials[number].params, trials[number].values, trials[number].state) == (params, values, state)
    assert not [t.number for t in trials.values() if t.state in (TrialState.RUNNING, TrialState.WAITING)]

    # The kills landed in trials, and each trial they interrupted was failed by the heartbeat check (no reason of
    # its own) and its plan evaluated to its end by a later trial: the retry RetryHeartbeatStaleTrialCallback
    # queued, or, where the process that failed the trial was itself killed before the callback queued the retry
    # (Optuna fails the trial and queues its retry in two steps), the search's own trial of that plan taking over
    # the dead trial's claim. (test_resume_kill checks the retry where nothing interferes.)
    assert len(interrupted) >= MIN_INTERRUPTED, f"only {len(interrupted)} of {KILLS} kills interrupted a trial"
    evaluated = evaluated_trials(study)
    finished_plans = {plan_key(trial_plan(t)) for t in evaluated if t.state == TrialState.COMPLETE}
    retried = {number for t in trials.values() for number in t.system_attrs.get("retry_history", [])}
    for number in interrupted:
        trial = trials[number]
        assert trial.state == TrialState.FAIL and "fail_reason" not in trial.user_attrs, number
        if "plan" in trial.user_attrs:    # killed after its whole plan was chosen (not while suggesting it)
            assert plan_key(trial_plan(trial)) in finished_plans, number
    assert retried, "no interrupted trial was queued again by the retry callback"

    # Every eval_fn call that returned was one trial's evaluation; no plan was evaluated by two trials.
    worker_workload.assert_each_call_is_a_trials_evaluation(tmp_path / "evals.log", study, killed)
    keys = [plan_key(trial_plan(t)) for t in evaluated]
    assert len(keys) == len(set(keys)), "a plan was evaluated twice"
    # Every trial is accounted for: interrupted by a kill; failed unstarted by a kill landing between two trials (at
    # most one per kill, together with the interrupted ones); evaluated (the budget, plus the retries run after it
    # was spent, at most one per interrupted trial); or a duplicate answered from the study: a plan whose trial a
    # kill cut short, queued twice (by the retry callback and by the search), runs once and answers the other trial
    # from its result, so at most one per trial cut short.
    unstarted = [n for n, t in trials.items() if worker_workload.runner_pid(t) is None and n not in interrupted]
    assert len(interrupted) + len(unstarted) <= KILLS
    assert MAX_TRIALS <= len(evaluated) <= MAX_TRIALS + len(interrupted)
    assert not {t.number for t in evaluated} & set(interrupted + unstarted)
    accounted = {t.number for t in evaluated} | set(interrupted) | set(unstarted)
    duplicates = [n for n, t in trials.items() if n not in accounted and t.user_attrs.get("duplicate")]
    assert len(duplicates) <= len(interrupted) + len(unstarted), f"{len(duplicates)} duplicate trials: {duplicates}"
    assert set(trials) == accounted | set(duplicates), \
        sorted((t.number, t.state.name, dict(t.user_attrs)) for n, t in trials.items() if n not in accounted)

    answer = [t for t in evaluated if trial_plan(t) == resume_workload.expected_plan()]
    assert len(answer) == 1 and answer[0].state == TrialState.COMPLETE and answer[0].user_attrs["passed"]
    best = study.user_attrs["autotune.best"]["plan"]
    assert all(best[resume_workload.module_name(b)] == "fp32" for b in resume_workload.SENSITIVE), best
    print(f"\n{KILLS} kills {min(delays):.2f}-{max(delays):.2f} s into a run's trials, {len(interrupted)} mid-trial "
          f"({len(set(interrupted) & retried)} retried by the callback); "
          f"{len(kept)} finished trials kept across them; {len(evaluated)} evaluated, {len(duplicates)} duplicate, "
          f"{len(unstarted)} unstarted trials at the end")
