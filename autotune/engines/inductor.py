"""The inductor engine: the eager plan (modules swapped, any dtype), then the whole model compiled by
`torch.compile`, so the casts at lowered modules' boundaries and the fp32 ops between them fuse. Its all-fp32
plan is plain `torch.compile(model)`, so the tuner's answer is never slower than that when this engine is on."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autotune.backends.base import CallInputs
from autotune.engines.base import compile_runnable, how_to_compile, save_module
from autotune.engines.eager import EagerEngine


@dataclass(frozen=True)
class InductorEngine(EagerEngine):
    name: str = "inductor"
    compiles_static_when_marked: bool = True

    def runnable(self, built: nn.Module) -> nn.Module:
        return compile_runnable(built)

    def save(self, built: nn.Module, inputs: CallInputs, path: str) -> str:
        save_module(built, path)
        return how_to_compile("torch.load(path, weights_only=False)", built) + ", where autotune is importable"
