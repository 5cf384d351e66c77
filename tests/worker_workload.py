"""The resume workload with an eval_fn that logs every call (process id and the plan it saw) to a file, so a
test counts evaluations across processes from what eval_fn itself saw, not from the tuner's trial labels. YAML
configs import it as `worker_workload:logged_eval`."""
from __future__ import annotations

import collections
import os
import time
from pathlib import Path

import optuna
import resume_workload
from optuna.trial import TrialState
from torch import nn

from autotune.search.trials import RUNNER_ATTR
from autotune.storage.study import evaluated_trials, trial_plan

BASELINE = "f" * resume_workload.BLOCKS


def plan_seen(model: nn.Module) -> str:
    """The dtype of each Linear position as the model holds it: int8 kernels have another module type."""
    return "".join("8" if "Int8" in type(layer).__name__ else "f" for layer in list(model)[::2])


def plan_code(plan: dict[str, str]) -> str:
    """A trial's plan written as plan_seen writes what eval_fn saw."""
    return "".join("8" if plan[resume_workload.module_name(b)] == "int8" else "f"
                   for b in range(resume_workload.BLOCKS))


def logged_eval(log_path: str, delay_s: float = 0.3):
    inner = resume_workload.fidelity_eval(delay_s=delay_s)

    def eval_fn(model: nn.Module) -> float:
        score = inner(model)
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()} {plan_seen(model)}\n")
        return score

    return eval_fn


def calls_by_process(log: Path) -> dict[int, list[str]]:
    """{pid: the plans of its eval_fn calls that returned, in order}."""
    calls: dict[int, list[str]] = collections.defaultdict(list)
    for line in (log.read_text().splitlines() if log.is_file() else []):
        pid, plan = line.split()
        calls[int(pid)].append(plan)
    return calls


def runner_pid(trial: optuna.trial.FrozenTrial) -> int | None:
    """The process that ran the trial's objective, None if it never started (a trial queued again after a crash
    carries its dead predecessor's mark, naming another trial)."""
    mark = str(trial.user_attrs.get(RUNNER_ATTR, ""))    # "<host>:<pid>:<run>:<trial number>"
    if not mark.endswith(f":{trial.number}"):
        return None
    return int(mark.split(":")[-3])


def assert_each_call_is_a_trials_evaluation(log: Path, study: optuna.Study, killed: set[int]) -> None:
    """Per process, its eval_fn calls that returned (the fp32 baseline aside) are, in order: one per trial it
    evaluated, with that trial's plan, in trial order; in a process SIGKILLed mid-trial (`killed` pids), maybe one
    with the interrupted trial's plan (its eval ended, the kill came before the result was committed); then at most
    one, the winner's re-evaluation, of a plan that passed. A call anywhere else (a plan evaluated again in a trial
    recorded as a duplicate, or outside any trial) fails."""
    trials = study.get_trials(deepcopy=False)
    evaluated = {t.number for t in evaluated_trials(study)}
    passing = {plan_code(trial_plan(t)) for t in trials
               if t.state == TrialState.COMPLETE and t.user_attrs.get("passed")}
    for pid, plans in calls_by_process(log).items():
        calls = [plan for plan in plans if plan != BASELINE]
        mine = [t for t in trials if runner_pid(t) == pid]
        position = 0
        for trial in mine:
            # A trial killed while its params were being suggested has part of them and no plan: nothing ran.
            code = plan_code(trial_plan(trial)) if "plan" in trial.user_attrs else None
            if trial.number in evaluated:
                assert calls[position:position + 1] == [code], \
                    f"process {pid}: trial {trial.number} ({code}) evaluated, but eval_fn saw {calls[position:]}"
                position += 1
            elif pid in killed and trial is mine[-1] and trial.state != TrialState.COMPLETE:
                position += calls[position:position + 1] == [code]    # the trial the kill interrupted
        rest = calls[position:]
        assert len(rest) <= 1 and set(rest) <= passing, \
            f"process {pid}: eval_fn calls {rest} after its trials {[t.number for t in mine]}"


def broken_eval():
    """An eval_fn whose data cannot be read: it fails at the fp32 baseline."""
    def eval_fn(model: nn.Module) -> float:
        raise RuntimeError("the dataset server is down")
    return eval_fn


def baseline_waiting_eval(log_path: str, flag_path: str, delay_s: float = 0.3, wait_s: float = 30.0):
    """logged_eval whose fp32 baseline call returns only once some process has started evaluating a lowered plan
    (it touches `flag_path`), or after `wait_s`: a run whose trials wait for the baseline shows it as a baseline
    that waited the whole `wait_s`. Appends "baseline waited <seconds>" to `log_path` + ".baseline"."""
    inner = logged_eval(log_path, delay_s)
    flag = Path(flag_path)

    def eval_fn(model: nn.Module) -> float:
        if plan_seen(model) != BASELINE:
            flag.touch()
            return inner(model)
        started = time.monotonic()
        score = inner(model)     # a capture of the first batches (cut short inside it) never gets past here
        while not flag.exists() and time.monotonic() - started < wait_s:
            time.sleep(0.05)
        with open(f"{log_path}.baseline", "a") as log:
            log.write(f"baseline waited {time.monotonic() - started:.1f}\n")
        return score

    return eval_fn
