"""Crash safety: `autotune tune` is SIGKILLed at 20 random moments and resumed by the same command each time.

After each kill, every trial that had finished is still there, unchanged. At the end: each finished trial is
present exactly once, no plan was evaluated twice, every trial a kill interrupted is FAILED (by the heartbeat
check, not left RUNNING) and its plan was retried, and the best plan is the one an uninterrupted run finds
(the workload has a single right answer, `resume_workload.expected_plan()`). The heartbeat is short here
(1 s, grace 2 s) so that a restarted process finds the killed trial stale at once.
"""
from __future__ import annotations

import random
import signal
import subprocess
import time
import warnings
from pathlib import Path

import optuna
import resume_workload
from optuna.storages import RetryFailedTrialCallback
from optuna.trial import TrialState
from test_resume_kill import cli_env, run_to_end, tune_command

from autotune.plan import plan_key
from autotune.storage.study import evaluated_trials, trial_plan

KILLS = 20
MAX_TRIALS = 10


def write_config(tmp_path: Path) -> Path:
    return resume_workload.write_config(
        tmp_path, "kills", {"eval_fn": "resume_workload:fidelity_eval", "kwargs": {"delay_s": 0.5}},
        max_trials=MAX_TRIALS, patience=100, repeats=3, heartbeat_interval=1, grace_period=2)


def finished(storage: str) -> dict[int, tuple]:
    """{trial number: (params, values, state)} of every finished trial, read with Optuna alone."""
    try:
        study = optuna.load_study(study_name="kills", storage=storage)
    except KeyError:          # killed before the study was created
        return {}
    return {t.number: (t.params, t.values, t.state) for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.FAIL)}


def test_twenty_kills_lose_nothing_and_reach_the_uninterrupted_answer(tmp_path):
    config = write_config(tmp_path)
    storage = f"sqlite:///{tmp_path}/s.db"
    moments = random.Random(20).sample([round(1.0 + 0.25 * i, 2) for i in range(36)], KILLS)  # 1 s .. 9.75 s
    kept: dict[int, tuple] = {}
    killed_mid_study = 0
    for moment in moments:
        proc = subprocess.Popen(tune_command(config), cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(moment)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        killed_mid_study += proc.returncode == -signal.SIGKILL
        now = finished(storage)
        for number, trial in kept.items():
            assert now.get(number) == trial, f"trial {number} changed or vanished after the kill at {moment} s"
        kept = now

    run_to_end(config, tmp_path, "final.log")
    study = optuna.load_study(study_name="kills", storage=storage)
    trials = {t.number: t for t in study.get_trials()}
    for number, (params, values, state) in kept.items():
        assert (trials[number].params, trials[number].values, trials[number].state) == (params, values, state)

    assert not [t.number for t in trials.values() if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    evaluated = evaluated_trials(study)
    keys = [plan_key(trial_plan(t)) for t in evaluated]
    assert len(keys) == len(set(keys)), "a plan was evaluated twice"
    assert len(evaluated) >= MAX_TRIALS

    # Trials a kill interrupted: FAILED with no reason of their own, and their plan run again by a retry trial.
    interrupted = [t for t in trials.values() if t.state == TrialState.FAIL and "fail_reason" not in t.user_attrs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retried = {RetryFailedTrialCallback.retried_trial_number(t) for t in trials.values()}
    finished_plans = {plan_key(trial_plan(t)) for t in trials.values() if t.state == TrialState.COMPLETE}
    for trial in interrupted:
        if trial.params:   # killed after its plan was chosen
            assert trial.number in retried or plan_key(trial_plan(trial)) in finished_plans, trial.number

    assert study.user_attrs["autotune.best"]["plan"] == resume_workload.expected_plan()
    print(f"\n{KILLS} kills ({killed_mid_study} while running); {len(kept)} finished trials kept across them; "
          f"{len(evaluated)} evaluated trials at the end, {len(interrupted)} interrupted trials failed and retried")
