"""The low-precision engine: the whole model in the plan's low dtype, as `model.half()` does (every float
parameter and buffer, so LayerNorm, embeddings, activations and residual adds run in it too), the modules the
plan keeps in fp32 as fp32 islands, with casts only where precision changes (into and out of an island, at the
model's float inputs and outputs, and into a module with low-dtype weights that an fp32 tensor built in the
forward reaches), then compiled by inductor. This is a GPU user's `torch.compile(
model.half())` with the tuner's fallback to fp32 where the tolerance needs it; on CPUs with native bf16 it runs
the same way. Numerics change beyond the plan's modules, so every finalist is re-evaluated as usual."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.clone import clone
from autotune.engines.base import Calibration, compile_runnable, hooks_on_it_unsaved, how_to_compile, save_module
from autotune.fused_paths import calls_children_as_modules
from autotune.model_call import STATE_DTYPE, entry_paths
from autotune.plan import Plan, low_dtype
from autotune.tree import map_tensors

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cast(value, dtype: torch.dtype):
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _cast(args, dtype), _cast(kwargs, dtype)


def _cast_output(dtype: torch.dtype, module: nn.Module, args: tuple, output):
    return _cast(output, dtype)


def _cast_at_edges(module: nn.Module, inside: torch.dtype, outside: torch.dtype) -> None:
    """Float inputs cast to `inside` on the way in, float outputs to `outside` on the way out (hooks, so module
    names and the model's class stay as they were)."""
    module.register_forward_pre_hook(functools.partial(_cast_inputs, inside), with_kwargs=True)
    module.register_forward_hook(functools.partial(_cast_output, outside))


def _cast_tensor_attributes(model: nn.Module, dtype: torch.dtype) -> None:
    """fp32 tensors a module holds as plain attributes, which `.to` leaves alone (it casts parameters and buffers),
    cast to `dtype`: caches filled on an earlier fp32 call. Wav2Vec2-Conformer's rotary table, kept so, turned its
    query and key to fp32 beside a value in the low dtype, which scaled_dot_product_attention refuses."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                setattr(module, name, value.to(dtype))


def _low_inputs(model: nn.Module, low: torch.dtype) -> None:
    """Float inputs of every module holding parameters in `low` cast to it on the way in: a tensor the forward
    builds in fp32 (a sinusoidal position table computed on the fly) turned the activations it met back to fp32,
    and the next LayerNorm or Linear refused them beside its `low` weights ("mixed dtype", "mat1 and mat2 must
    have the same dtype"). Inputs already in `low` pass untouched; the fp32 islands hold fp32 parameters."""
    for module in model.modules():
        if any(parameter.dtype == low for parameter in module.parameters(recurse=False)):
            module.register_forward_pre_hook(functools.partial(_cast_inputs, low), with_kwargs=True)


@dataclass(frozen=True)
class LowPrecisionEngine:
    name: str = "lowp"
    keeps_model: bool = True
    lowers_unplanned: bool = True
    compiles_static_when_marked: bool = True
    calibrates_on_batches: bool = False

    def unsupported(self, plan: Plan, fp32: nn.Module) -> str | None:
        lowered = set(plan.values()) - {"fp32"}
        if not lowered:
            return "the plan keeps every module in fp32"
        if not lowered <= set(LOW):
            return f"the low-precision engine realises {sorted(LOW)} and fp32 only, not {sorted(lowered - set(LOW))}"
        if len(lowered) > 1:
            return "the low-precision engine runs one low dtype per model"
        return hooks_on_it_unsaved(fp32)     # the casts at the model's edges

    def build(self, fp32: nn.Module, plan: Plan, calibration: Calibration) -> nn.Module:
        low = LOW[low_dtype(plan)]
        model = clone(fp32).to(low)
        _cast_tensor_attributes(model, low)
        _cast_at_edges(model, low, torch.float32)
        setattr(model, STATE_DTYPE, low)       # generate's KV cache: what its own calls computed, in `low`
        for path in entry_paths(calibration.batches):
            _cast_at_edges(model.get_submodule(path), low, torch.float32)   # generate's encoder, called apart
        islands = [name for name, dtype in plan.items() if dtype == "fp32"]
        for name in islands:
            # A copy of the fp32 module, its weights never rounded and its own: one tied to a module in the low
            # dtype (an LM head sharing the embedding's weight) stays fp32 here and low there.
            island = clone(fp32.get_submodule(name))
            model.set_submodule(name, island)
            _cast_at_edges(island, torch.float32, low)
        _low_inputs(model, low)
        # A transformer encoder's fused path bypasses an island (its kernel reads the weights) or hands it nested
        # tensors, which an fp32 MultiheadAttention off that path refuses.
        calls_children_as_modules(model, islands)
        return model

    def runnable(self, built: nn.Module) -> nn.Module:
        return compile_runnable(built)

    def save(self, built: nn.Module, inputs: CallInputs, path: str) -> str:
        save_module(built, path)
        return how_to_compile("torch.load(path, weights_only=False)", built) + ", where autotune is importable"

    def load(self, path: str) -> nn.Module:
        return torch.load(path, weights_only=False)
