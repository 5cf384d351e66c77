"""The tuner's storage writes a trial's params in one transaction and stays a plain Optuna RDB storage."""
from __future__ import annotations

import multiprocessing

import optuna
import pytest
import sqlalchemy

from autotune.storage import open_storage

PARAMS = 100
QUEUED = 60      # trials queued for WORKERS processes to pop at once
WORKERS = 4


def suggest_all(trial: optuna.Trial, choices=("int8", "bf16", "fp32")) -> dict[str, str]:
    return {f"m{i}": trial.suggest_categorical(f"m{i}", list(choices)) for i in range(PARAMS)}


def test_params_land_in_one_transaction_and_plain_optuna_reads_them(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    storage = open_storage(url)
    commits = []
    sqlalchemy.event.listen(storage.engine, "commit", lambda _connection: commits.append(1))
    study = optuna.create_study(study_name="s", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    suggested = {}

    def objective(trial):
        before = len(commits)
        suggested[trial.number] = suggest_all(trial)
        trial.set_user_attr("plan", suggested[trial.number])      # the pending params are written first
        assert len(commits) - before < 10, f"{PARAMS} params should not take a commit each"
        return 1.0

    study.optimize(objective, n_trials=3)
    reread = optuna.load_study(study_name="s", storage=url)    # Optuna's own storage, no autotune code
    assert [t.params for t in reread.trials] == [suggested[n] for n in range(3)]
    assert all(t.distributions["m0"] == optuna.distributions.CategoricalDistribution(["int8", "bf16", "fp32"])
               for t in reread.trials)


def test_a_running_trials_params_are_visible_to_other_processes_after_its_next_write(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    seen = {}

    def objective(trial):
        plan = suggest_all(trial)
        trial.set_user_attr("plan_key", "claimed")
        other = optuna.load_study(study_name="s", storage=url)
        seen.update(other.trials[trial.number].params)
        assert other.trials[trial.number].state == optuna.trial.TrialState.RUNNING
        return float(len(plan))

    study.optimize(objective, n_trials=1)
    assert len(seen) == PARAMS


def test_an_incompatible_distribution_is_refused_as_optuna_refuses_it(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    optuna.create_study(study_name="s", storage=open_storage(url)).optimize(lambda t: len(suggest_all(t)), n_trials=1)
    study = optuna.load_study(study_name="s", storage=open_storage(url))  # a fresh process: nothing cached

    def objective(trial):
        suggest_all(trial, choices=("int8", "fp16"))
        trial.set_user_attr("plan", "x")
        return 0.0

    with pytest.raises(ValueError, match="does not support dynamic value space"):
        study.optimize(objective, n_trials=1)
    assert optuna.load_study(study_name="s", storage=url).trials[1].params == {}


def _pop_all(url: str) -> list[int]:
    study = optuna.load_study(study_name="q", storage=open_storage(url))
    popped = []
    while (trial_id := study._pop_waiting_trial_id()) is not None:   # what study.optimize does for a queued trial
        popped.append(trial_id)
    return popped


def test_concurrent_workers_never_pop_the_same_queued_trial(tmp_path):
    url = f"sqlite:///{tmp_path}/q.db"
    study = optuna.create_study(study_name="q", storage=open_storage(url))
    for index in range(QUEUED):
        study.enqueue_trial({"x": index})
    with multiprocessing.get_context("spawn").Pool(WORKERS) as pool:
        popped = [trial_id for ids in pool.map(_pop_all, [url] * WORKERS) for trial_id in ids]
    assert sorted(popped) == sorted(set(popped)), "a queued trial was handed to two workers"
    assert len(popped) == QUEUED
