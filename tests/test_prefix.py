"""Sensitivity answers what runs before a lowered unit from the reference forward: the same errors, fewer calls."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autotune.capture import record_module_inputs
from autotune.measure import prefix
from autotune.measure.sensitivity import module_sensitivity


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.inner(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))   # a container never called itself
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x *= 0.5   # in place on a block's output: what a replayed block returns must be a copy
        return self.head(x)


class Drifting(nn.Module):
    """Returns more on each call: a module with state, which a record cannot answer for."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.calls


def sensitivity_and_calls(net: nn.Module, candidates: dict[str, list[str]], inputs) -> tuple[dict, dict[str, int]]:
    calibration = record_module_inputs(net, list(candidates), inputs)
    calls: dict[str, int] = {}
    for name, module in net.named_modules():
        module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    return module_sensitivity(net, candidates, inputs, calibration), calls


def full_forward_sensitivity(monkeypatch, net, candidates, inputs) -> dict:
    monkeypatch.setattr(prefix, "MAX_RECORDED_BYTES", -1)   # nothing may be kept: every forward runs in full
    errors = module_sensitivity(net, candidates, inputs, record_module_inputs(net, list(candidates), inputs))
    monkeypatch.undo()
    return errors


def test_modules_finished_before_a_lowered_unit_are_not_run_again_and_the_errors_are_unchanged(monkeypatch):
    torch.manual_seed(0)
    net, inputs = Net().eval(), ((torch.randn(32, 16),), {})
    candidates = {"blocks.0.inner": ["int8", "bf16", "fp32"], "blocks.2.inner": ["int8", "bf16", "fp32"],
                  "head": ["int8", "fp32"]}
    errors, calls = sensitivity_and_calls(net, candidates, inputs)
    calls = dict(calls)   # before the full forwards below add theirs
    assert errors == full_forward_sensitivity(monkeypatch, net, candidates, inputs)
    assert errors["head"]["int8"] > 0 and errors["blocks.0.inner"]["bf16"] > 0
    # Counted on the blocks' ReLUs, which run only where their block does (a replayed block's hooks still fire).
    # Reference and record forwards run every block; the check forward replays them all (the head's prefix).
    # Then blocks.0.inner's two dtypes run every block, blocks.2.inner's two only blocks.2, the head's none.
    assert calls["blocks.0.act"] == calls["blocks.1.act"] == 2 + 2
    assert calls["blocks.2.act"] == 2 + 2 + 2


def test_a_model_whose_modules_keep_state_runs_every_forward_in_full():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), Drifting(), nn.Linear(16, 4)).eval()
    inputs = ((torch.randn(8, 16),), {})
    output, replay = prefix.PrefixReplay.record(net, inputs, [["2"]], lambda ref, out: (out - ref).norm().item())
    assert replay is None       # the check forward saw the record answer differently from the module
    output, replay = prefix.PrefixReplay.record(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).eval(), inputs,
                                                [["1"]], lambda ref, out: (out - ref).norm().item())
    assert replay is not None


def test_outputs_past_the_memory_bound_are_not_kept(monkeypatch):
    net, inputs = Net().eval(), ((torch.randn(32, 16),), {})
    monkeypatch.setattr(prefix, "MAX_RECORDED_BYTES", 32 * 16 * 4 - 1)   # less than one block's output
    output, replay = prefix.PrefixReplay.record(net, inputs, [["head"]], lambda ref, out: 0.0)
    assert replay is None and output.shape == (32, 4)


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_the_last_module_lowered_costs_no_forward_of_the_rest(dtype):
    torch.manual_seed(0)
    net, inputs = Net().eval(), ((torch.randn(32, 16),), {})
    errors, calls = sensitivity_and_calls(net, {"head": [dtype, "fp32"]}, inputs)
    assert errors["head"][dtype] > 0
    assert calls["blocks.0.act"] == calls["blocks.2.act"] == 2   # reference and record forwards only


def test_a_parent_that_needs_what_a_skipped_forward_sets_runs_every_forward_in_full():
    class Remembers(nn.Linear):
        def forward(self, x):
            self.last = x.shape[0]
            return super().forward(x)

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = Remembers(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            out = self.first(x)
            del self.first.last      # the record's answer sets nothing: this raises when `first` is skipped
            return self.second(out)

    output, replay = prefix.PrefixReplay.record(Reads().eval(), ((torch.randn(8, 16),), {}), [["second"]],
                                                lambda ref, out: 0.0)
    assert replay is None and output.shape == (8, 4)


class TwiceRegistered(nn.Module):
    """A TCN block's layout: its convolutions are attributes of the block and members of a Sequential it calls."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(8, 8, 3, padding=1), nn.Conv1d(8, 8, 3, padding=1)
        self.net = nn.Sequential(self.conv1, nn.ReLU(), self.conv2)

    def forward(self, x):
        return torch.relu(self.net(x) + x)


def test_a_module_registered_under_two_parents_is_lowered_and_replayed_once_wherever_it_is_called(monkeypatch):
    # Lowered by one name only, the module the forward calls (through the Sequential) stayed fp32 and its error read
    # 0; replayed twice, restoring its forward raised AttributeError and the run stopped.
    torch.manual_seed(0)
    net = nn.Sequential(TwiceRegistered(), TwiceRegistered(), nn.Conv1d(8, 2, 1)).eval()
    candidates = {name: ["bf16", "fp32"] for name in ("0.conv1", "0.conv2", "1.conv1", "1.conv2", "2")}
    inputs = ((torch.randn(4, 8, 32),), {})
    errors, _ = sensitivity_and_calls(net, candidates, inputs)
    assert all(errors[name]["bf16"] > 0 for name in candidates), errors
    assert errors == full_forward_sensitivity(monkeypatch, net, candidates, inputs)


class TwiceInOneParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = self.first          # one module under two names of the same parent

    def forward(self, x):
        return self.second(torch.relu(x)) + 0.5


def test_a_module_registered_twice_in_one_parent_is_lowered_under_both_names():
    from autotune.plan import replace_module

    net, lowered = TwiceInOneParent(), nn.Identity()
    assert replace_module(net, "first", lowered) is net and net.first is lowered and net.second is lowered


class SamplesItsLatent(nn.Module):
    """A VAE: its forward samples the latent, a new draw on every call."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encode, self.decode, self.head = nn.Linear(16, 64), nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        mean, log_var = self.encode(x).chunk(2, dim=-1)
        latent = mean + torch.randn_like(mean) * (0.5 * log_var).exp()
        return self.head(torch.relu(self.decode(latent)))


def test_a_forward_that_samples_draws_the_same_numbers_in_every_signal_so_they_measure_the_lowering():
    """Each forward drew anew: every module and dtype of a VAE read the same error, the difference of two draws,
    and the search was blind. The caller's random state is left as it was."""
    net, inputs = SamplesItsLatent().eval(), ((torch.randn(64, 16),), {})
    candidates = {name: ["bf16", "fp32"] for name in ("encode", "decode", "head")}
    calibration = record_module_inputs(net, list(candidates), inputs)
    state = torch.get_rng_state()
    errors = module_sensitivity(net, candidates, inputs, calibration)
    assert torch.equal(torch.get_rng_state(), state)
    draws = [torch.randn(64, 32) for _ in range(2)]
    with torch.no_grad():    # what two draws differ by, the noise the signals read before
        noise = (net.head(torch.relu(net.decode(draws[0]))) - net.head(torch.relu(net.decode(draws[1])))).norm()
        noise /= net.head(torch.relu(net.decode(draws[0]))).norm()
    assert noise > 0.3 and all(0 < errors[name]["bf16"] < 0.05 for name in candidates), (noise, errors)
