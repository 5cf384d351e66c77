"""int8 on CPU through FBGEMM's quantized kernels (the aten ops under torch.ao, not its deprecated Python API).

Chosen by measurement on the CPUs we run on (see README, "Kernel paths"): torchao's int8 dynamic-activation
Linear only pays off under torch.compile (eager it measured 0.41-1.34x of fp32 on an AVX-512 host and ~25x
slower on an AVX2 host), while FBGEMM dynamic Linear measured 0.29-0.41x (AVX-512 VNNI) and 0.67-0.91x (AVX2).
Conv2d uses static activation quantisation calibrated on the inputs the module saw (0.41-0.76x on AVX2).
Weights are per output channel, symmetric. Activations use 7 bits (reduce_range) because FBGEMM's AVX2 path
accumulates pairs in int16 and saturates with 8: measured 2.2e-2 vs 1.1e-1 relative error on Linear.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.clone import copy_module_state

_ACT_QMAX = 127  # reduce_range: see module docstring


def _per_channel_qweight(weight: torch.Tensor) -> torch.Tensor:
    weight = weight.detach().float()
    amax = weight.abs().flatten(1).amax(dim=1).clamp(min=1e-8)
    scales = (amax / 127).double()
    zero_points = torch.zeros_like(scales, dtype=torch.long)
    with warnings.catch_warnings():  # quantized-tensor creation warns of a future removal; this path is swappable
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)


def _affine_qparams(tensor: torch.Tensor) -> tuple[float, int]:
    low = min(tensor.min().item(), 0.0)
    high = max(tensor.max().item(), 0.0)
    scale = max((high - low) / _ACT_QMAX, 1e-8)
    zero_point = int(min(max(round(-low / scale), 0), _ACT_QMAX))
    return scale, zero_point


def _qint8_nbytes(qweight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Bytes of int8 weights, their per-channel scales and zero points, and the bias."""
    per_channel = qweight.q_per_channel_scales().numel() * 16 if qweight.qscheme() != torch.per_tensor_affine else 16
    return qweight.numel() + per_channel + (bias.numel() * bias.element_size() if bias is not None else 0)


class _PackedInt8(nn.Module):
    """Holds FBGEMM's packed weights, which no op changes in place: copies of the module share them."""

    _packed: torch.ScriptObject
    _nbytes: int

    def __deepcopy__(self, memo: dict) -> "_PackedInt8":
        memo[id(self._packed)] = self._packed
        return copy_module_state(self, memo)

    def weight_nbytes(self) -> int:
        return self._nbytes


class DynamicInt8Linear(_PackedInt8):
    """Linear with int8 weights; activations quantised per batch at run time (no calibration needed)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float()
        qweight = _per_channel_qweight(linear.weight)
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self._nbytes = _qint8_nbytes(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.quantized.linear_dynamic(x.float(), self._packed, True)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic (fbgemm)"


class StaticInt8Conv2d(_PackedInt8):
    """Conv2d with int8 weights and int8 activations whose ranges were calibrated on real inputs."""

    def __init__(self, conv: nn.Conv2d, calibration: CallInputs):
        super().__init__()
        x = calibration[0][0].detach().float()
        with torch.no_grad():
            y = conv(x.to(conv.weight.dtype)).float()
        self.in_scale, self.in_zero_point = _affine_qparams(x)
        self.out_scale, self.out_zero_point = _affine_qparams(y)
        bias = None if conv.bias is None else conv.bias.detach().float()
        qweight = _per_channel_qweight(conv.weight)
        self._packed = torch.ops.quantized.conv2d_prepack(
            qweight, bias, list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups)
        self._nbytes = _qint8_nbytes(qweight, bias)
        self.summary = f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unbatched = x.dim() == 3
        q = torch.quantize_per_tensor(x.float().unsqueeze(0) if unbatched else x.float(),
                                      self.in_scale, self.in_zero_point, torch.quint8)
        out = torch.ops.quantized.conv2d(q, self._packed, self.out_scale, self.out_zero_point).dequantize()
        return (out.squeeze(0) if unbatched else out).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.summary}, int8 static (fbgemm)"


class Int8Backend:
    name = "int8"

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        if device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
            return False
        if type(module) is nn.Linear:
            return True
        return (type(module) is nn.Conv2d and module.padding_mode == "zeros"
                and not isinstance(module.padding, str))

    def apply(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        torch.backends.quantized.engine = "fbgemm"
        if type(module) is nn.Linear:
            return DynamicInt8Linear(module)
        if calibration is None:
            raise ValueError("int8 Conv2d needs the inputs the module saw, for calibration")
        return StaticInt8Conv2d(module, calibration)
