"""Steady allocation: freed activations are not faulted in again on the next call, and a study records it."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from conftest import HalfCostMeasurer, fidelity
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.measure import steady_allocation
from autotune.storage import study as studies

# Five 20 MiB activations allocated, written and freed per "call", as a model's forward does: with glibc's
# defaults the heap hands them back past its moving trim threshold and the next call faults every page in again.
CALLS = """
import resource, sys
import torch
if sys.argv[1] == "steady":
    from autotune.measure import steady_allocation
    steady_allocation()
def call():
    for block in [torch.empty(5 << 20) for _ in range(5)]:
        block.fill_(1.0)
for _ in range(3):
    call()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    call()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(sorted(faults)[:-1]) / 4)   # the worst call left out
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds fixed are glibc's")


def faults_per_call(mode: str) -> float:
    """Minor page faults a call, over five calls after three warm-up calls, the worst one left out: glibc's
    defaults fault every other call; fixed thresholds on none once the heap has grown (it may still grow once,
    late, in one call)."""
    out = subprocess.run([sys.executable, "-c", CALLS, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@glibc_only
def test_freed_activations_are_reused_instead_of_faulted_in_again():
    default, steady = faults_per_call("default"), faults_per_call("steady")
    pages = 5 * (20 << 20) // 4096
    assert default > pages / 10, f"glibc's defaults re-faulted only {default} pages a call: the case this fixes"
    assert steady < pages / 100, f"{steady} minor faults a call with the thresholds fixed"


@glibc_only
def test_steady_allocation_says_what_it_fixed():
    assert steady_allocation().startswith("glibc malloc thresholds fixed (M_MMAP_THRESHOLD 32 MiB")


@pytest.mark.parametrize("steady", [True, False])
def test_the_study_records_how_memory_was_allocated_while_timing(tmp_path, steady):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    x = torch.randn(4, 8)
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["bf16", "fp32"]), tolerable_loss=0.5,
                          max_trials=2, steady_allocation=steady, storage=f"sqlite:///{tmp_path}/a.db")
    result = autotune(model, config, fidelity(model, x), x, measurer=HalfCostMeasurer(["0", "2"]))
    recorded = studies.get_attr(result.study, "settings")["allocation"]
    assert recorded == (steady_allocation() if steady else
                        "allocator not fixed by this run (steady_allocation: false)")
