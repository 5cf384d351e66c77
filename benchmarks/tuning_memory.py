"""Resident memory through one tuning of a transformer encoder (12 layers of d768: 86 M parameters, 327 MiB),
phase by phase: each line of the tuner's log with the process's RSS then and its peak so far.

    .venv/bin/python benchmarks/tuning_memory.py [--layers 12] [--batch 8] [--seq 128] [--trials 8]

Run it under a memory limit to see what the tuner does when memory runs short (a v1 cgroup, as root):
    mkdir /sys/fs/cgroup/memory/tune && echo 3600M > /sys/fs/cgroup/memory/tune/memory.limit_in_bytes
    sh -c 'echo $$ > /sys/fs/cgroup/memory/tune/cgroup.procs; exec .venv/bin/python benchmarks/tuning_memory.py'
eval_fn is the argmax agreement with the fp32 model over 4 random batches (an untrained model: every plan passes,
so the finalists are as many as they get).
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.measure.memory import rss_bytes

MIB = 2 ** 20


class Encoder(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.embed = nn.Embedding(1000, 768)
        layer = nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(768, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class PeakRss:
    """The process's RSS, sampled every 50 ms in a thread: the peak between log lines is seen too."""

    def __init__(self):
        self.peak = rss_bytes()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.05)


class Phases(logging.Handler):
    def __init__(self, peak: PeakRss, started: float):
        super().__init__()
        self.peak, self.started = peak, started

    def emit(self, record: logging.LogRecord) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s  rss {rss_bytes() / MIB:6.0f} MiB  peak "
              f"{self.peak.peak / MIB:6.0f}] {record.getMessage()[:140]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Encoder(args.layers).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    data = [torch.randint(0, 1000, (args.batch, args.seq)) for _ in range(4)]
    with torch.no_grad():
        expected = [model(x).argmax(-1) for x in data]

    def eval_fn(candidate: nn.Module) -> float:
        with torch.no_grad():
            return sum((candidate(x).argmax(-1) == y).float().mean().item() for x, y in zip(data, expected)) / 4

    peak, started = PeakRss(), time.monotonic()
    logging.getLogger("autotune").addHandler(Phases(peak, started))
    logging.getLogger("autotune").setLevel(logging.INFO)
    print(f"weights {weights / MIB:.0f} MiB; rss before tuning {rss_bytes() / MIB:.0f} MiB")
    with tempfile.TemporaryDirectory() as folder:
        result = autotune(model, TuningConfig(
            config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.05,
            max_trials=args.trials, storage=f"sqlite:///{Path(folder) / 'memory.db'}",
            compile_cache=str(Path(folder) / "cache")), eval_fn)
        print(result.summary())
    print(f"peak rss {peak.peak / MIB:.0f} MiB: {peak.peak / weights:.1f}x the weights")


if __name__ == "__main__":
    main()
