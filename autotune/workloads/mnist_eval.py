"""eval_fn factory for YAML configs: `evaluation: {eval_fn: "autotune.workloads.mnist_eval:digits_eval"}`."""
from __future__ import annotations

from autotune.workloads.mnist import accuracy_eval, digits


def digits_eval(limit: int | None = 2000, batch_size: int = 250):
    """Top-1 accuracy on the first `limit` shipped MNIST digits (class-balanced)."""
    return accuracy_eval(*digits(limit), batch_size=batch_size)
