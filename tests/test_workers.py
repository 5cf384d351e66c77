"""Several processes tune one study at once (`autotune tune CONFIG --workers N`) on one SQLite file.

Every evaluated plan appears once in the study, no eval_fn call repeats a plan another worker evaluated, no
trial is left running or queued, and no "database is locked" error reaches the user.
"""
from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import resume_workload
from optuna.trial import TrialState
from test_resume_kill import cli_env
from worker_workload import plan_code

from autotune.plan import plan_key
from autotune.storage.study import evaluated_trials, get_attr, trial_plan

MAX_TRIALS = 12


def write_config(tmp_path: Path, log: Path) -> Path:
    return resume_workload.write_config(
        tmp_path, "workers",
        {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log), "delay_s": 0.3}},
        max_trials=MAX_TRIALS, patience=100, repeats=3)


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_share_one_study_without_repeating_or_losing_a_plan(tmp_path, workers):
    log = tmp_path / "evals.log"
    config = write_config(tmp_path, log)
    # A file named as a module of Python's own, in the working directory: the helpers alone imported it.
    (tmp_path / "concurrent.py").write_text("raise ImportError('the working directory shadowed Python')\n")
    done = subprocess.run([str(Path(sys.executable).parent / "autotune"), "tune", str(config), "--workers",
                           str(workers)], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "database is locked" not in output

    study = optuna.load_study(study_name="workers", storage=f"sqlite:///{tmp_path}/s.db")
    evaluated = evaluated_trials(study)
    keys = [plan_key(trial_plan(t)) for t in evaluated]
    assert len(keys) == len(set(keys)), "a plan was evaluated in two trials"
    # The budget is shared, not per worker, and holds: trials under way count against it (each worker started one
    # more at the last step, up to workers - 1 past it).
    assert len(evaluated) == MAX_TRIALS
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING))

    calls = [line.split() for line in log.read_text().splitlines()]
    per_pid = collections.Counter(pid for pid, _ in calls)
    lowered = collections.Counter(plan for _, plan in calls if "8" in plan)
    # Each lowered plan is evaluated by one trial; the starting process scores finalists for the win once more:
    # the fastest in their race, and the next where the first, timed again on its own, ran slower than that one
    # raced (four workers share two cores here), or none where no finalist re-timed faster than fp32.
    trial_codes = {f"trial {t.number}": plan_code(trial_plan(t)) for t in evaluated}
    scored_for_the_win = collections.Counter(
        trial_codes[name] for name, outcome in get_attr(study, "finalist_evaluated").items()
        if outcome.startswith(("passed:", "missed:")) and "8" in trial_codes.get(name, ""))
    assert lowered == collections.Counter(trial_codes.values()) + scored_for_the_win, lowered
    # A helper that starts after the others spent the budget (four processes import torch on two cores here) runs
    # no trial, and says so; the work is still shared and every call is one some process reported.
    reported = {pid: int(count) for pid, count in re.findall(r"worker (\d+): (\d+) eval_fn calls?\b", output)}
    assert len(reported) == workers - 1, output
    assert len(per_pid) >= 2, "the trials were shared between processes"
    assert len(per_pid.keys() - reported.keys()) <= 1, "only the starting process calls eval_fn unreported"
    assert all(per_pid[pid] == count for pid, count in reported.items()), (per_pid, reported)


def test_a_second_worker_runs_trials_while_the_first_evaluates_the_baseline(tmp_path):
    log, flag = tmp_path / "evals.log", tmp_path / "lowered-started"
    config = resume_workload.write_config(
        tmp_path, "overlap",
        {"eval_fn": "worker_workload:baseline_waiting_eval",
         "kwargs": {"log_path": str(log), "flag_path": str(flag), "delay_s": 0.3, "wait_s": 30.0}},
        max_trials=6, patience=100, repeats=3)
    done = subprocess.run([sys.executable, "-m", "autotune", "tune", str(config), "--workers", "2"],
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    # The baseline's one eval_fn call ended as soon as a lowered plan was being evaluated: the helper did not wait
    # for it to start its first trial.
    waits = [float(line.split()[-1]) for line in Path(f"{log}.baseline").read_text().splitlines()]
    assert len(waits) == 1 and waits[0] < 30.0, waits
    study = optuna.load_study(study_name="overlap", storage=f"sqlite:///{tmp_path}/s.db")
    baseline = get_attr(study, "baseline_accuracy")
    evaluated = evaluated_trials(study)
    assert len(evaluated) >= 6
    for trial in evaluated:    # every trial judged against the one stored baseline, whichever worker ran it
        assert trial.user_attrs["accuracy_loss"] == pytest.approx(
            (baseline - trial.user_attrs["accuracy"]) / abs(baseline), abs=1e-12)
        assert trial.user_attrs["passed"] == (trial.user_attrs["accuracy_loss"] <= 0.01)


@pytest.mark.parametrize("moment", ["evaluating", "helpers starting", "twice"])
def test_ctrl_c_at_a_terminal_says_so_once_for_all_the_processes(tmp_path, moment):
    """A terminal's Ctrl-C reaches the process group: `tune --workers 3` printed its "Error: interrupted" line three
    times, once per process; one that came while the helpers still imported torch printed their tracebacks; a
    second Ctrl-C ended the process by the signal."""
    import os
    import signal
    import time

    log = tmp_path / "evals.log"
    config = write_config(tmp_path, log)
    tune = subprocess.Popen([sys.executable, "-m", "autotune", "tune", str(config), "--workers", "3"],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)   # a process group of its own, as a terminal's job is
    if moment == "helpers starting":
        assert "3 workers" in tune.stdout.readline()      # printed as the helper processes are started
        time.sleep(0.5)
    else:
        deadline = time.monotonic() + 240
        while len({line.split()[0] for line in (log.read_text().splitlines() if log.exists() else [])}) < 2 \
                and time.monotonic() < deadline and tune.poll() is None:
            time.sleep(0.2)      # two processes evaluating plans
    os.killpg(tune.pid, signal.SIGINT)
    if moment == "twice":
        time.sleep(0.5)
        os.killpg(tune.pid, signal.SIGINT)
    out, err = tune.communicate(timeout=120)
    assert tune.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("Error:")] == [
        "Error: interrupted; every finished trial is kept: run the same command again to resume"], err


@pytest.mark.skipif(sys.platform != "linux", reason="a helper learns of its parent's death from Linux's prctl")
def test_a_helper_worker_stops_when_the_tune_that_started_it_is_killed(tmp_path):
    """SIGKILL of `tune --workers 2` left its helper process tuning on alone, its parent gone."""
    import os
    import signal
    import time

    log = tmp_path / "evals.log"
    tune = subprocess.Popen([sys.executable, "-m", "autotune", "tune", str(write_config(tmp_path, log)), "--workers",
                             "2"], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and tune.poll() is None:
        pids = {int(line.split()[0]) for line in (log.read_text().splitlines() if log.exists() else [])}
        if len(pids - {tune.pid}) == 1:
            break
        time.sleep(0.2)
    (helper,) = pids - {tune.pid}     # evaluating plans
    tune.send_signal(signal.SIGKILL)
    tune.wait()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:     # gone, or a zombie its new parent has not reaped yet
            if Path(f"/proc/{helper}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.2)
    os.kill(helper, signal.SIGKILL)
    raise AssertionError(f"helper {helper} still ran 120 s after its tune was killed")
