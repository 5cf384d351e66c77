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
