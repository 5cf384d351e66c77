"""The resume workload with an eval_fn that logs every call (process id and the plan it saw) to a file, so a
test can count evaluations across worker processes. YAML configs import it as `worker_workload:logged_eval`."""
from __future__ import annotations

import os

import resume_workload
from torch import nn


def plan_seen(model: nn.Module) -> str:
    """The dtype of each Linear position as the model holds it: int8 kernels have another module type."""
    return "".join("8" if "Int8" in type(layer).__name__ else "f" for layer in list(model)[::2])


def logged_eval(log_path: str, delay_s: float = 0.3):
    inner = resume_workload.fidelity_eval(delay_s=delay_s)

    def eval_fn(model: nn.Module) -> float:
        score = inner(model)
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()} {plan_seen(model)}\n")
        return score

    return eval_fn


def broken_eval():
    """An eval_fn whose data cannot be read: it fails at the fp32 baseline."""
    def eval_fn(model: nn.Module) -> float:
        raise RuntimeError("the dataset server is down")
    return eval_fn
