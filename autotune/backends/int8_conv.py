"""int8 Conv2d and Conv1d with static activation quantisation: input and output ranges calibrated on the inputs
the module really saw. A Conv1d runs as the Conv2d of height 1 it equals (FBGEMM has no 1-d quantized conv)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from autotune.backends.base import CallInputs, Technique
from autotune.backends.quantized import (
    PackedInt8,
    activation_qmax,
    affine_qparams,
    engine_available,
    explicit_padding,
    per_channel_qweight,
    plain_type,
    quantized_engine,
    resolve_reduce_range,
)


class StaticInt8Conv2d(PackedInt8):
    """Conv2d with int8 weights and int8 activations whose ranges were calibrated on real inputs."""

    computed_with = ("in_scale", "in_zero_point", "out_scale", "out_zero_point")

    def __init__(self, conv: nn.Conv2d, calibration: CallInputs, reduce_range: bool, engine: str):
        super().__init__()
        x = calibration[0][0].detach().float()
        with torch.no_grad():
            y = conv(x.to(conv.weight.dtype)).float()
        self.reduce_range, self.engine = reduce_range, engine
        qmax = activation_qmax(reduce_range)
        self.in_scale, self.in_zero_point = affine_qparams(x, qmax)
        self.out_scale, self.out_zero_point = affine_qparams(y, qmax)
        bias = None if conv.bias is None else conv.bias.detach().float()
        qweight = per_channel_qweight(conv.weight)
        with quantized_engine(engine):
            self._packed = torch.ops.quantized.conv2d_prepack(
                qweight, bias, list(conv.stride), list(explicit_padding(conv)), list(conv.dilation), conv.groups)
        self._keep(qweight, bias, conv.weight.dtype)
        self.summary = f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
            setattr(self, name, getattr(conv, name))     # what parents read of a conv (Whisper: conv1.stride)

    def _unpack(self) -> torch.Tensor:
        return torch.ops.quantized.conv2d_unpack(self._packed)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unbatched = x.dim() == 3
        q = torch.quantize_per_tensor(x.float().unsqueeze(0) if unbatched else x.float(),
                                      self.in_scale, self.in_zero_point, torch.quint8)
        out = torch.ops.quantized.conv2d(q, self._packed, self.out_scale, self.out_zero_point).dequantize()
        return (out.squeeze(0) if unbatched else out).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.summary}, int8 static"


def conv1d_as_conv2d(conv: nn.Conv1d) -> nn.Conv2d:
    """The Conv2d of height 1 that `conv` equals over (N, C, 1, L), on its weights (zero padding as numbers)."""
    as_2d = nn.Conv2d(conv.in_channels, conv.out_channels, (1, conv.kernel_size[0]), (1, conv.stride[0]),
                      (0, explicit_padding(conv)[0]), (1, conv.dilation[0]), conv.groups, conv.bias is not None,
                      device="meta")
    as_2d.weight = nn.Parameter(conv.weight.detach().unsqueeze(2), requires_grad=False)
    if conv.bias is not None:
        as_2d.bias = nn.Parameter(conv.bias.detach(), requires_grad=False)
    return as_2d


class Conv1dAsConv2d(nn.Module):
    """An nn.Conv1d computed as the Conv2d of height 1 it equals (conv1d_as_conv2d), in fp32: torchao's x86
    quantizer annotates a conv2d alone or with what follows it, a conv1d only where an nn.ReLU module follows."""

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        self.conv = conv1d_as_conv2d(conv)
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"):
            setattr(self, name, getattr(conv, name))     # the Conv1d's own, as parents read them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(-2)).squeeze(-2)


class StaticInt8Conv1d(StaticInt8Conv2d):
    """Conv1d with int8 weights and calibrated int8 activations, run as a Conv2d over (N, C, 1, L)."""

    def __init__(self, conv: nn.Conv1d, calibration: CallInputs, reduce_range: bool, engine: str):
        super().__init__(conv1d_as_conv2d(conv), ((calibration[0][0].unsqueeze(-2),), {}), reduce_range, engine)
        self.summary = f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"
        for name in ("kernel_size", "stride", "padding", "dilation"):
            setattr(self, name, getattr(conv, name))     # the Conv1d's own, as parents read them

    def _unpack(self) -> torch.Tensor:
        return super()._unpack().squeeze(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.unsqueeze(-2)).squeeze(-2)


@dataclass(frozen=True)
class Int8StaticConv2dConfig(Technique):
    """`nn.Conv2d` in int8, activation ranges calibrated on the inputs the module saw (min / max)."""

    name: ClassVar[str] = "int8"
    takes: ClassVar[type[nn.Module]] = nn.Conv2d
    builds: ClassVar[type[StaticInt8Conv2d]] = StaticInt8Conv2d
    reduce_range: bool | None = None     # 7-bit activations; None: where the CPU needs them (quantized)
    # x86 runs a depthwise convolution in oneDNN, where FBGEMM's, given 8-bit activations on an AVX512-VNNI CPU,
    # saturates (10x the error of a dense one); the others in FBGEMM or oneDNN, as fast as FBGEMM alone or faster.
    engine: str = "x86"

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return (plain_type(module) is self.takes and module.padding_mode == "zeros"
                and explicit_padding(module) is not None and engine_available(self.engine, device))

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        if calibration is None:
            raise ValueError(f"int8 {self.takes.__name__} needs the inputs the module saw, for calibration: pass "
                             "apply_plan(model, plan, example_inputs=...) inputs for one call of the model")
        return self.builds(module, calibration, resolve_reduce_range(self.reduce_range), self.engine)


@dataclass(frozen=True)
class Int8StaticConv1dConfig(Int8StaticConv2dConfig):
    """`nn.Conv1d` in int8 (audio front ends, temporal convolutions), calibrated as the Conv2d config is."""

    takes: ClassVar[type[nn.Module]] = nn.Conv1d
    builds: ClassVar[type[StaticInt8Conv2d]] = StaticInt8Conv1d
