"""The tuner's storage: Optuna's RDBStorage with SQLite set up for several workers, and the claim and lease
tables that decide who runs what across processes."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import threading
import time

import optuna
import pytest
import sqlalchemy
from conftest import refusing_connections

from autotune.storage.claims import PlanClaims, lease, plan_claims
from autotune.storage.rdb import lost_connection, open_storage, reachable

QUEUED = 60      # trials queued for WORKERS processes to pop at once
WORKERS = 4
KEYS = 40        # plans WORKERS processes claim at once


def test_sqlite_runs_in_wal_mode_with_normal_sync_a_minute_lock_wait_and_locks_as_transactions_begin(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    storage = open_storage(url)
    optuna.create_study(study_name="s", storage=storage)
    with storage.engine.connect() as connection:
        pragma = lambda name: connection.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
        assert (pragma("journal_mode"), pragma("synchronous"), pragma("busy_timeout")) == ("wal", 1, 60000)
    with storage.engine.begin() as connection:     # holds the write lock from BEGIN, before any write
        connection.exec_driver_sql("SELECT 1")
        other = sqlite3.connect(tmp_path / "s.db", timeout=0.1)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()


_barrier = None   # set in each pool process: every worker pops (or claims) at the same moment


def _share_barrier(barrier) -> None:
    global _barrier
    _barrier = barrier


def _pop_in_rounds(url: str) -> list[int]:
    """Pops one queued trial per round; every round starts when all workers are at the barrier, so each pop races
    WORKERS - 1 others for the same rows."""
    study = optuna.load_study(study_name="q", storage=open_storage(url))
    popped = []
    for _ in range(QUEUED // WORKERS):
        _barrier.wait(timeout=120)
        trial_id = study._pop_waiting_trial_id()   # what study.optimize does for a queued trial
        if trial_id is not None:
            popped.append(trial_id)
    return popped


def _racing_pool(context, workers: int):
    return context.Pool(workers, initializer=_share_barrier, initargs=(context.Barrier(workers),))


def test_concurrent_workers_never_pop_the_same_queued_trial(tmp_path):
    url = f"sqlite:///{tmp_path}/q.db"
    study = optuna.create_study(study_name="q", storage=open_storage(url))
    for index in range(QUEUED):
        study.enqueue_trial({"x": index})
    with _racing_pool(multiprocessing.get_context("spawn"), WORKERS) as pool:
        per_worker = pool.map(_pop_in_rounds, [url] * WORKERS, chunksize=1)
    popped = [trial_id for ids in per_worker for trial_id in ids]
    assert sorted(popped) == sorted(set(popped)), "a queued trial was handed to two workers"
    assert len(popped) == QUEUED
    # Each round had a queued trial for every worker, so each worker got one in every round, and the WORKERS
    # oldest queued trials went in that round, one to each: the pops raced, they did not take turns.
    assert [len(ids) for ids in per_worker] == [QUEUED // WORKERS] * WORKERS
    in_order = sorted(popped)
    for round_ in range(QUEUED // WORKERS):
        assert sorted(ids[round_] for ids in per_worker) == in_order[WORKERS * round_:WORKERS * (round_ + 1)]


def _study_with_trials(url: str, n: int) -> optuna.Study:
    study = optuna.create_study(study_name="s", storage=open_storage(url, heartbeat_interval=None))
    for _ in range(n):
        study.ask()      # RUNNING trials, numbered 0..n-1
    return study


def test_a_plan_is_claimed_by_one_trial_and_moves_only_from_the_holder_named(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    study = _study_with_trials(url, 3)
    claims = PlanClaims(open_storage(url), "s")
    assert claims.holder("plan-a") is None
    assert claims.claim("plan-a", 0) == 0
    assert claims.claim("plan-a", 1) == 0 and claims.holder("plan-a") == 0
    assert claims.claim("plan-b", 1) == 1
    assert not claims.take_over("plan-a", 1, 2), "trial 1 does not hold plan-a"
    study.tell(0, state=optuna.trial.TrialState.FAIL)
    assert claims.state_of(0) == optuna.trial.TrialState.FAIL
    assert claims.take_over("plan-a", 0, 2) and claims.holder("plan-a") == 2
    assert not claims.take_over("plan-a", 0, 1), "a plan moves once from a dead holder"
    assert PlanClaims(open_storage(url), "s").holder("plan-a") == 2     # another process reads the same


def test_a_study_deleted_outside_autotune_and_tuned_again_under_its_name_is_not_held_up_by_its_claims(tmp_path):
    """optuna-dashboard's or optuna.delete_study's delete leaves the claims table alone: the next tuning of that name
    met a claim held by a trial number its new study did not have and ended on "unexpected KeyError: 'No trial
    with trial number 1 exists'"."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from simulator import SimWorkload

    from autotune import TuningConfig, autotune
    url, sim = f"sqlite:///{tmp_path}/s.db", SimWorkload(6, eval_cost_s=0)
    config = TuningConfig(engines=["eager"], max_trials=5, repeats=3, storage=url, study_name="again")
    first = autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())
    with sqlalchemy.create_engine(url).begin() as connection:    # as a longer study of that name would leave them
        connection.execute(plan_claims.update().values(trial_number=plan_claims.c.trial_number + 100))
    optuna.delete_study(study_name="again", storage=url)
    again = autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())
    assert again.plan == first.plan and again.trials_evaluated == first.trials_evaluated
    assert not [t for t in again.study.trials if t.state == optuna.trial.TrialState.FAIL]


def _claim_all(url: str, number: int) -> dict[str, int]:
    claims = PlanClaims(open_storage(url), "s")
    _barrier.wait(timeout=120)
    return {f"plan-{k}": claims.claim(f"plan-{k}", number) for k in range(KEYS)}


def test_processes_claiming_the_same_plans_at_once_agree_on_one_holder_each(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    _study_with_trials(url, WORKERS)
    PlanClaims(open_storage(url), "s")     # the tables exist before the race, as after any study's first run
    with _racing_pool(multiprocessing.get_context("spawn"), WORKERS) as pool:
        seen = pool.starmap(_claim_all, [(url, number) for number in range(WORKERS)], chunksize=1)
    for key in seen[0]:
        holders = {answers[key] for answers in seen}
        assert len(holders) == 1, f"{key}: processes disagree about its holder: {holders}"
    won = [sum(answers[key] == number for key in answers) for number, answers in enumerate(seen)]
    assert sum(won) == KEYS


def _hold_lease(url: str, ready, ttl_s: float) -> None:
    with lease(open_storage(url), "s", "setup", ttl_s=ttl_s):
        ready.set()
        time.sleep(600)


def test_a_lease_is_exclusive_renewed_while_held_and_freed_when_its_holder_dies(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold_lease, args=(url, ready, 2.0))
    holder.start()
    entered = []

    def take_lease():
        with lease(open_storage(url), "s", "setup", ttl_s=2.0, poll_s=0.05):
            entered.append(time.monotonic())

    try:
        assert ready.wait(60)
        waiter = threading.Thread(target=take_lease, daemon=True)
        waiter.start()
        waiter.join(5.0)       # past the ttl: only the holder's renewals keep the lease (renewed every 0.67 s)
        assert not entered, "a second holder entered a held lease"
        killed = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        waiter.join(10)
        assert entered and entered[0] - killed < 6, "the lease of a dead holder was not freed"
    finally:
        holder.kill()
        holder.join()
    storage = open_storage(url)
    with lease(storage, "s", "setup", ttl_s=30, poll_s=0.05):      # released on exit: taken again at once
        with storage.engine.connect() as connection:
            assert connection.execute(sqlalchemy.text("SELECT COUNT(*) FROM autotune_leases")).scalar() == 1


def test_a_lease_renewal_that_fails_once_is_tried_again_not_given_up(tmp_path, monkeypatch, caplog):
    """A renewal meeting a locked SQLite file or a dropped connection ended the renewing thread in silence: the
    lease then expired under its live holder, and a second worker entered it."""
    from autotune.storage import claims

    update, failed = claims.leases.update, []

    def locked_once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise sqlalchemy.exc.OperationalError("UPDATE autotune_leases", {}, Exception("database is locked"))
        return update(*args, **kwargs)
    monkeypatch.setattr(claims.leases, "update", locked_once)
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    with lease(storage, "s", "setup", ttl_s=0.6, poll_s=0.05):
        time.sleep(1.5)     # past the ttl: only the renewals after the failed one keep it
        with storage.engine.connect() as connection:
            expires = connection.execute(sqlalchemy.text("SELECT expires_at FROM autotune_leases")).scalar()
    assert failed and expires > time.time() - 0.1
    assert "lease setup of study s: renewing failed (OperationalError" in caplog.text


def test_a_trial_killed_before_its_heartbeat_started_is_failed_after_the_grace_period(tmp_path):
    from autotune.search.trials import RUNNER_ATTR, fail_stale_trials
    study = optuna.create_study(study_name="s", storage=open_storage(f"sqlite:///{tmp_path}/s.db",
                                                                     heartbeat_interval=None))
    orphan, live, requeued = study.ask(), study.ask(), study.ask()      # no heartbeat: as if killed at once
    live.set_user_attr(RUNNER_ATTR, f"host:1:abc:{live.number}")
    requeued.set_user_attr(RUNNER_ATTR, f"host:1:abc:{orphan.number}")   # a dead predecessor's mark
    fail_stale_trials(study, grace_period=60)
    assert {t.number for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))} == {0, 1, 2}
    time.sleep(0.05)
    fail_stale_trials(study, grace_period=0.01)
    states = {t.number: t.state for t in study.trials}
    assert states == {orphan.number: optuna.trial.TrialState.FAIL, live.number: optuna.trial.TrialState.RUNNING,
                      requeued.number: optuna.trial.TrialState.FAIL}


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_trial_whose_heartbeat_stopped_is_failed_after_the_grace_period_and_its_plan_queued_again(tmp_path):
    from autotune.search.trials import RUNNER_ATTR, fail_stale_trials
    storage = open_storage(f"sqlite:///{tmp_path}/s.db", heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="s", storage=storage)
    dtype = optuna.distributions.CategoricalDistribution(["int8", "fp32"])
    dead, live = study.ask({"fc": dtype}), study.ask({"fc": dtype})
    for trial in (dead, live):
        trial.set_user_attr(RUNNER_ATTR, f"host:1:abc:{trial.number}")   # both reached the objective
        storage.record_heartbeat(trial._trial_id)
    stop = threading.Event()

    def beat() -> None:    # what Optuna's heartbeat thread does for the live trial's process
        while not stop.wait(0.2):
            storage.record_heartbeat(live._trial_id)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        fail_stale_trials(study, grace_period=2)     # within the grace period: nothing is failed
        assert {t.number: t.state.name for t in study.trials} == {dead.number: "RUNNING", live.number: "RUNNING"}
        time.sleep(3)                                # past the grace period without a beat from `dead`
        fail_stale_trials(study, grace_period=2)
    finally:
        stop.set()
        beating.join()
    trials = study.trials
    assert [t.state.name for t in trials[:2]] == ["FAIL", "RUNNING"]
    assert "fail_reason" not in trials[dead.number].user_attrs      # failed by the check, not by its eval_fn
    queued = [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
    assert len(queued) == 1 and queued[0].params == trials[dead.number].params
    assert queued[0].system_attrs.get("failed_trial") == dead.number    # RetryHeartbeatStaleTrialCallback's mark


def test_trials_in_flight_outside_the_guided_phase_count_against_the_shared_patience(tmp_path):
    from types import SimpleNamespace

    from autotune.search.driver import Patience
    from autotune.storage.study import view_trials
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    guided, sampled = study.ask(), study.ask()
    guided.set_user_attr("source", "guided")       # the guided phase has no patience
    study.enqueue_trial({"x": 1})                  # queued by the exhaustive phase or a crash: still to come
    view = view_trials(study)
    assert (view.waiting, view.unguided_in_flight) == (1, 2)
    # One stale trial and two to come reach a patience of 3: a third worker starts nothing more.
    assert Patience(3, SimpleNamespace(stale=1, unguided_in_flight=view.unguided_in_flight)).spent
    study.tell(sampled, 1.0)
    view = view_trials(study)
    assert view.unguided_in_flight == 1
    assert not Patience(3, SimpleNamespace(stale=1, unguided_in_flight=view.unguided_in_flight)).spent


def test_a_postgres_storage_replaces_the_connections_its_server_closed(postgres_server, postgres):
    study = optuna.create_study(study_name="s", storage=open_storage(postgres))
    study.set_user_attr("before", 1)
    with refusing_connections(postgres_server, postgres):    # closes the pooled connection, as a restart would
        pass
    study.set_user_attr("after", 2)
    assert optuna.load_study(study_name="s", storage=postgres).user_attrs == {"before": 1, "after": 2}


def test_a_lost_database_is_told_from_an_error_in_what_was_asked_of_it(postgres_server, postgres):
    storage = open_storage(postgres)
    study = optuna.create_study(study_name="s", storage=storage)
    with pytest.raises(sqlalchemy.exc.IntegrityError) as duplicate, storage.engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE t (k int PRIMARY KEY); INSERT INTO t VALUES (1), (1)")
    assert not lost_connection(duplicate.value, storage.engine)
    with refusing_connections(postgres_server, postgres):
        assert not reachable(storage.engine)
        with pytest.raises(Exception) as refused:    # Optuna's own error, raised from SQLAlchemy's
            study.set_user_attr("during", 1)
        assert lost_connection(refused.value, storage.engine)
    assert reachable(storage.engine)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_heartbeats_go_on_after_the_database_refused_some(postgres_server, postgres, caplog):
    from autotune.search.trials import RUNNER_ATTR, fail_stale_trials
    storage = open_storage(postgres, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    trial.set_user_attr(RUNNER_ATTR, f"host:1:abc:{trial.number}")
    with refusing_connections(postgres_server, postgres), caplog.at_level("WARNING", logger="autotune"):
        for _ in range(2):   # Optuna's heartbeat thread would end at the first that raised
            storage.record_heartbeat(trial._trial_id)
    assert caplog.text.count("heartbeat could not be written") == 1, caplog.text
    storage.record_heartbeat(trial._trial_id)
    fail_stale_trials(study, grace_period=2)
    assert study.trials[0].state == optuna.trial.TrialState.RUNNING    # its last beat is fresh
