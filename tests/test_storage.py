"""The tuner's storage writes a trial's params in one transaction and stays a plain Optuna RDB storage."""
from __future__ import annotations

import multiprocessing

import optuna
import pytest
import sqlalchemy

from autotune.storage import open_storage
from autotune.study import plan_lock

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


def test_a_running_trials_writes_reach_other_processes_when_the_plan_lock_is_released(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    seen = {}

    def objective(trial):
        with plan_lock(url, study):
            plan = suggest_all(trial)
            trial.set_user_attr("plan_key", "claimed")
            held = optuna.load_study(study_name="s", storage=url).trials[trial.number]
            assert "plan_key" not in held.user_attrs       # batched, not yet written
        other = optuna.load_study(study_name="s", storage=url).trials[trial.number]
        seen.update(params=other.params, attrs=other.user_attrs, state=other.state)
        return float(len(plan))

    study.optimize(objective, n_trials=1)
    assert len(seen["params"]) == PARAMS
    assert seen["attrs"] == {"plan_key": "claimed"}
    assert seen["state"] == optuna.trial.TrialState.RUNNING


@pytest.mark.parametrize("dialect_upsert", [True, False], ids=["upsert", "optuna-per-attribute"])
def test_a_trials_attributes_are_written_in_one_transaction_and_read_back_by_plain_optuna(tmp_path, monkeypatch,
                                                                                          dialect_upsert):
    if not dialect_upsert:   # a database without a known upsert (e.g. MySQL) takes Optuna's write per attribute
        monkeypatch.setattr("autotune.storage._UPSERTS", {})
    url = f"sqlite:///{tmp_path}/s.db"
    storage = open_storage(url)
    writes = []
    sqlalchemy.event.listen(storage.engine, "before_cursor_execute",
                            lambda _c, _cursor, statement, *_: writes.append(statement)
                            if statement.startswith("INSERT INTO trial_user_attributes") else None)
    study = optuna.create_study(study_name="s", storage=storage)
    attrs = {"accuracy": 0.91, "passed": True, "plan": {"a": "int8"}, "summary": "int8×1", "n": None}

    def objective(trial):
        before = len(writes)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("accuracy", 0.92)                    # the last value written wins
        storage.flush()
        if dialect_upsert:
            assert len(writes) - before == 1, "one statement for all of a trial's attributes"
        return 1.0

    study.optimize(objective, n_trials=2)
    assert [t.user_attrs for t in optuna.load_study(study_name="s", storage=url).trials] == \
        [attrs | {"accuracy": 0.92}] * 2


def test_reads_match_optunas_own_storage(tmp_path):
    """The storage reads trials back with its own queries; Optuna's RDBStorage must read the same."""
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=open_storage(url), directions=["minimize", "minimize"])

    def objective(trial):
        suggest_all(trial)
        trial.suggest_float("x", 0.1, 1.0, log=True)
        trial.set_user_attr("plan", {"m0": "int8"})
        trial.set_constraint("accuracy", -0.5)
        if trial.number == 1:
            raise ValueError("a failed trial keeps its params")
        return float("inf") if trial.number == 2 else 1.5, -float(trial.number)

    study.optimize(objective, n_trials=4, catch=(ValueError,))
    study.enqueue_trial({"m0": "fp32"}, user_attrs={"source": "queued"})
    ours = open_storage(url)
    plain = optuna.storages.RDBStorage(url)
    study_id = plain.get_study_id_from_name("s")
    theirs = plain.get_all_trials(study_id)
    assert len(theirs) == 5
    assert ours.get_all_trials(study_id) == theirs
    assert [ours.get_trial(t._trial_id) for t in theirs] == theirs
    assert ours._get_trials(study_id, None, {theirs[1]._trial_id}, theirs[2]._trial_id) == [theirs[1], theirs[3],
                                                                                          theirs[4]]


def test_a_trial_this_process_runs_reads_back_from_one_query_as_optuna_reads_it(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    storage = open_storage(url, heartbeat_interval=None)    # trials asked for by hand: no heartbeat
    study = optuna.create_study(study_name="s", storage=storage)
    plain = optuna.storages.RDBStorage(url)      # another process's view: Optuna's own storage
    selects = []
    sqlalchemy.event.listen(storage.engine, "before_cursor_execute",
                            lambda *args: selects.append(1) if args[2].lstrip().startswith("SELECT") else None)

    def read_both(trial_id: int) -> tuple[optuna.trial.FrozenTrial, optuna.trial.FrozenTrial, int]:
        storage.flush()
        before = len(selects)
        ours = storage.get_trial(trial_id)
        return ours, plain.get_trial(trial_id), len(selects) - before

    study.enqueue_trial({"m0": "fp32"}, user_attrs={"source": "queued"})
    for trial in (study.ask(), study.ask()):      # a queued trial taken, then a new one
        suggest_all(trial)
        trial.suggest_float("x", 0.1, 1.0, log=True)
        trial.set_user_attr("plan", {"m0": ("int8",)})    # a tuple reads back as a list, as from the database
        trial.set_constraint("accuracy", -0.5)
        trial.report(0.25, step=3)
        ours, theirs, queries = read_both(trial._trial_id)
        assert ours == theirs and ours.params["m0"] in ("int8", "bf16", "fp32")
        assert ours.user_attrs["plan"] == {"m0": ["int8"]} and ours.intermediate_values == {3: 0.25}
        assert queries == 1, "a running trial of this process is read from its row alone"
    plain.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)     # another process fails it
    ours, theirs, _ = read_both(trial._trial_id)
    assert ours == theirs and ours.state == optuna.trial.TrialState.FAIL


def test_an_incompatible_distribution_is_refused_as_optuna_refuses_it(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    optuna.create_study(study_name="s", storage=open_storage(url)).optimize(lambda t: len(suggest_all(t)), n_trials=1)
    study = optuna.load_study(study_name="s", storage=open_storage(url))  # a fresh process: nothing cached

    def objective(trial):
        suggest_all(trial, choices=("int8", "fp16"))
        with plan_lock(url, study):     # the tuner's claim: pending writes go out as the lock is released
            trial.set_user_attr("plan", "x")
        return 0.0

    with pytest.raises(ValueError, match="does not support dynamic value space"):
        study.optimize(objective, n_trials=1)
    refused = optuna.load_study(study_name="s", storage=url).trials[1]
    assert refused.params == {} and refused.user_attrs == {}


def test_choices_optuna_counts_as_equal_are_stored_as_each_trial_wrote_them(tmp_path):
    """1, 1.0 and True compare equal, so Optuna accepts each after the other; each trial keeps its own JSON."""
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    choice_sets = [(1, 2), (True, 2), (1.0, 2)]
    for choices in choice_sets:
        study.optimize(lambda trial, c=choices: float(trial.suggest_categorical("x", list(c)) is c[0]), n_trials=1)
    reread = optuna.load_study(study_name="s", storage=url).trials   # Optuna's own storage reads them back
    assert [[(type(c), c) for c in t.distributions["x"].choices] for t in reread] == \
        [[(type(c), c) for c in choices] for choices in choice_sets]


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


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_plan_holders_come_from_one_query_and_match_a_scan_of_the_trials(tmp_path):
    from autotune.study import plan_holders
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=open_storage(url))
    for key in ("a", "b", "a"):
        trial = study.ask()
        trial.set_user_attr("plan_key", key)
        study.tell(trial, 1.0)
    running = study.ask()
    running.set_user_attr("plan_key", "b")
    holders = plan_holders(study, "b")
    assert holders == {1: optuna.trial.TrialState.COMPLETE, 3: optuna.trial.TrialState.RUNNING}
    assert plan_holders(study, "a") == {0: optuna.trial.TrialState.COMPLETE, 2: optuna.trial.TrialState.COMPLETE}
    assert plan_holders(study, "c") == {}
    in_memory = optuna.create_study()
    for trial in study.trials:
        in_memory.add_trial(trial) if trial.state.is_finished() else None
    assert plan_holders(in_memory, "a") == plan_holders(study, "a")
