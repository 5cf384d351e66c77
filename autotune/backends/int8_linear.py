"""int8 Linear with dynamic activation quantisation: int8 weights, activations quantised per call (no
calibration needed)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from autotune.backends.base import CallInputs, Technique
from autotune.backends.linear_engine import DEFAULT_ENGINE, dynamic_linear_engine, timed_rows
from autotune.backends.quantized import (
    PackedInt8,
    engine_available,
    per_channel_qweight,
    plain_type,
    quantized_engine,
    resolve_reduce_range,
)


class DynamicInt8Linear(PackedInt8):
    """Linear with int8 weights; activations quantised per batch at run time."""

    def __init__(self, linear: nn.Linear, reduce_range: bool, engine: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.reduce_range, self.engine = reduce_range, engine
        bias = None if linear.bias is None else linear.bias.detach().float()
        qweight = per_channel_qweight(linear.weight)
        with quantized_engine(engine):
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self._keep(qweight, bias, linear.weight.dtype)

    def _unpack(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack(self._packed)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(x.float(), self._packed, self.reduce_range)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic"


@dataclass(frozen=True)
class Int8DynamicLinearConfig(Technique):
    """`nn.Linear` in int8 with per-channel weights and activations quantised per call."""

    name: ClassVar[str] = "int8"
    reduce_range: bool | None = None     # 7-bit activations; None: where the CPU needs them (quantized)
    engine: str | None = None            # None: FBGEMM, or oneDNN where it runs the module faster (linear_engine)

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return plain_type(module) is nn.Linear and engine_available(self.engine or DEFAULT_ENGINE, device)

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return self.lowered(module, calibration)

    def calibration_kept(self, calibration: CallInputs) -> CallInputs:
        """The rows the engine choice times, where it is made."""
        args, _ = calibration
        return ((timed_rows(args[0]),), {}) if self.engine is None and args else ((), {})

    def lowered(self, linear: nn.Linear, calibration: CallInputs | None) -> DynamicInt8Linear:
        """`linear` in int8, packed for this config's engine or the one measured faster on its recorded input."""
        reduce_range = resolve_reduce_range(self.reduce_range)
        engine = self.engine
        if engine is None:
            x = calibration[0][0] if calibration and calibration[0] else None
            engine = dynamic_linear_engine(linear, x, reduce_range)
        return DynamicInt8Linear(linear, reduce_range, engine)


def is_gpt_conv1d(module: nn.Module) -> bool:
    """Whether `module` is transformers' GPT-style Conv1D (GPT-2's projections): y = x @ W + b with W stored
    (in, out). Told by its class name and fields, so transformers need not be imported."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None)))


@dataclass(frozen=True)
class Int8DynamicConv1DConfig(Int8DynamicLinearConfig):
    """transformers' GPT-style `Conv1D` in int8, as the `nn.Linear` it computes."""

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return is_gpt_conv1d(module) and engine_available(self.engine or DEFAULT_ENGINE, device)

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return self.lowered(conv1d_as_linear(module), calibration)


def linear_on(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear computing with `weight` (out features x in features) and `bias`: Parameters as they are (shared
    with the module holding them), other tensors as Parameters without gradients."""
    def parameter(tensor: torch.Tensor) -> nn.Parameter:
        return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = parameter(weight)
    if bias is not None:
        linear.bias = parameter(bias)
    return linear


def conv1d_as_linear(module: nn.Module) -> nn.Linear:
    """The nn.Linear a GPT-style Conv1D computes, on its weight transposed into a tensor of its own (see
    autotune.engines.pt2e for why not a view)."""
    return linear_on(module.weight.detach().t().contiguous(), None if module.bias is None else module.bias.detach())
