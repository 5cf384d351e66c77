"""optuna-dashboard on studies the tuner made: a real server (the `optuna-dashboard` console script, given its
storage in a TOML file as docker/compose.yaml gives it) on 127.0.0.1, read over HTTP through its JSON API, on
SQLite and on a real PostgreSQL server, then stopped."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import HalfCostMeasurer
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune

pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (it is pinned in requirements.txt)")

DASHBOARD = Path(sys.executable).with_name("optuna-dashboard")
NAMES = ["0", "1", "2"]
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def tuned_study(storage: str, study_name: str):
    """A study made by `autotune` itself: a tiny Sequential, int8 or fp32 per Linear."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Linear(16, 16) for _ in NAMES)).eval(), torch.randn(8, 16)
    reference = model(x).detach()

    def eval_fn(m):
        return 1 - ((m(x) - reference).norm() / reference.norm()).item()

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          max_trials=4, storage=storage, study_name=study_name)
    return autotune(model, config, eval_fn, x, measurer=HalfCostMeasurer(NAMES)).study


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with NO_PROXY.open(url, timeout=timeout) as response:
        assert response.status == 200, url
        return json.loads(response.read())


class Dashboard:
    """`optuna-dashboard --from-config FILE` on a free loopback port; the storage URL (with any password) is in
    the file, not on the command line. Retries on another port if the one picked was taken meanwhile."""

    def __init__(self, storage: str, folder: Path):
        self.config, self.log = folder / "dashboard.toml", folder / "dashboard.log"
        self.config.write_text(f"[optuna_dashboard]\nstorage = {json.dumps(storage)}\n")
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        for _ in range(3):
            port = free_port()
            with self.log.open("wb") as log:
                self.process = subprocess.Popen(
                    [str(DASHBOARD), "--from-config", str(self.config), "--host", "127.0.0.1", "--port", str(port)],
                    stdout=log, stderr=subprocess.STDOUT)
            base = f"http://127.0.0.1:{port}"
            if self._wait_up(base, deadline=time.monotonic() + 60):
                return base
            self.__exit__()
        raise AssertionError(f"optuna-dashboard did not answer:\n{self.log.read_text()[-3000:]}")

    def _wait_up(self, base: str, deadline: float) -> bool:
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                get_json(f"{base}/api/meta", timeout=2)
                return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        return False

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/studies.db"
    return request.getfixturevalue("postgres")     # conftest: a new database on a real PostgreSQL server


@pytest.mark.skipif(not DASHBOARD.exists(), reason=f"no optuna-dashboard console script beside {sys.executable}")
def test_the_dashboard_lists_a_tuned_study_and_shows_its_trials(storage, tmp_path):
    study = tuned_study(storage, "dashboard-toy")
    trials = {t.number: t for t in study.trials}
    assert trials, "the tuner made no trial"

    dashboard = Dashboard(storage, tmp_path)
    with dashboard as base:
        summaries = get_json(f"{base}/api/studies")["study_summaries"]
        listed = {s["study_name"]: s for s in summaries}
        assert set(listed) == {"dashboard-toy"}
        summary = listed["dashboard-toy"]
        assert summary["directions"] == ["minimize"]                   # latency as a ratio of fp32
        attrs = {a["key"] for a in summary["user_attrs"]}
        assert {"autotune.baseline_accuracy", "autotune.best"} <= attrs

        detail = get_json(f"{base}/api/studies/{summary['study_id']}")
        assert {t["number"] for t in detail["trials"]} == set(trials)
        for shown in detail["trials"]:
            trial = trials[shown["number"]]
            assert shown["state"].upper() == trial.state.name
            assert {p["name"]: p["param_external_value"] for p in shown["params"]} == \
                {name: str(value) for name, value in trial.params.items()}
        assert [t["number"] for t in detail["best_trials"]] == [study.best_trial.number]

    assert dashboard.process.poll() is not None                        # stopped, and its port closed
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(base.rsplit(":", 1)[1]))) != 0
