"""What the int8 techniques share: FBGEMM's quantized kernels (the aten ops under torch.ao, not its deprecated
Python API), per-output-channel symmetric int8 weights, and modules holding packed weights.

Activations use 7 bits (`reduce_range`) where FBGEMM's kernels add products in pairs into int16, which saturates
with 8 (AVX2, AVX-512 without VNNI), and 8 bits where the CPU has AVX512-VNNI, which adds them into int32: half
the error there (README, "Kernel paths", has the measured errors)."""
from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from autotune.clone import copy_module_state


@contextmanager
def quantized_engine(engine: str) -> Iterator[None]:
    """Packs weights for `engine`, leaving the process-wide quantized engine as it was (a packed weight keeps its
    engine's kernels)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def engine_available(engine: str, device: torch.device) -> bool:
    return device.type == "cpu" and engine in torch.backends.quantized.supported_engines


def per_channel_qweight(weight: torch.Tensor) -> torch.Tensor:
    weight = weight.detach().float()
    amax = weight.abs().flatten(1).amax(dim=1).clamp(min=1e-8)
    scales = (amax / 127).double()
    zero_points = torch.zeros_like(scales, dtype=torch.long)
    with warnings.catch_warnings():  # quantized-tensor creation warns of a future removal; this path is swappable
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)


def plain_type(module: nn.Module) -> type:
    """The torch class whose forward `module` runs: its own, or for a module with parametrizations (weight_norm:
    audio models' convolutions) the class torch derived it from, whose forward reads the computed weight."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def explicit_padding(conv: nn.Module) -> tuple[int, ...] | None:
    """A convolution's padding as integers: its own, or what "valid" / "same" pad (None where "same" pads one
    side more than the other: an even dilated kernel)."""
    if not isinstance(conv.padding, str):
        return tuple(conv.padding)
    if conv.padding == "valid":
        return (0,) * len(conv.kernel_size)
    totals = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
    return tuple(t // 2 for t in totals) if all(t % 2 == 0 for t in totals) else None


@functools.cache
def has_avx512_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in info)
    except OSError:     # not Linux: assume the saturating kind
        return False


def resolve_reduce_range(reduce_range: bool | None) -> bool:
    """A technique's `reduce_range`, None meaning this CPU's: 7-bit activations unless it has AVX512-VNNI."""
    return not has_avx512_vnni() if reduce_range is None else reduce_range


def activation_qmax(reduce_range: bool) -> int:
    return 127 if reduce_range else 255


def affine_qparams(tensor: torch.Tensor, qmax: int) -> tuple[float, int]:
    """Scale and zero point mapping [min(tensor, 0), max(tensor, 0)] onto [0, qmax]."""
    low = min(tensor.min().item(), 0.0)
    high = max(tensor.max().item(), 0.0)
    scale = max((high - low) / qmax, 1e-8)
    zero_point = int(min(max(round(-low / scale), 0), qmax))
    return scale, zero_point


def qint8_nbytes(qweight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Bytes of int8 weights, their per-channel scales and zero points, and the bias."""
    per_channel = qweight.q_per_channel_scales().numel() * 16 if qweight.qscheme() != torch.per_tensor_affine else 16
    return qweight.numel() + per_channel + (bias.numel() * bias.element_size() if bias is not None else 0)


class Int8Kernels(nn.Module):
    """What every module running FBGEMM's int8 kernels holds: packed weights (`_packed`: one, or a list of them),
    which no op changes in place, so copies of the module share them; the bytes of its int8 weights; the activation
    bits it was built with (`reduce_range`); the quantized engine that packed them (`engine`), which packs them
    again when the module is unpickled, so a saved model computes what was measured (another engine's kernels
    round differently). One built with 8 bits (on a CPU with AVX512-VNNI) and unpickled on a CPU without it warns:
    its kernels can saturate there, so it may score below what was measured.

    Each subclass's forward runs outside torch.compile's graphs (torch.compiler.disable): dynamo cannot trace these
    kernels and breaks the graph at them anyway, and tracing into one under autocast (the inductor engine's
    `autocast` knob) crashed the process in torch 2.13 (a segmentation fault at a quantized::conv2d on a pooled
    input). Outside the graph, they run as in eager."""

    _packed: torch.ScriptObject | list[torch.ScriptObject]
    _nbytes: int
    reduce_range: bool
    engine: str
    computed_with: tuple[str, ...] = ()   # plain attributes the kernels compute with (static activation ranges)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in vars(cls):
            cls.forward = torch.compiler.disable(cls.forward)

    def __deepcopy__(self, memo: dict) -> Int8Kernels:
        memo[id(self._packed)] = self._packed
        return copy_module_state(self, memo)

    def __getstate__(self) -> dict:
        # The packed weights are pickled as the bytes torch.save makes of them: unpickled directly (torch.load of a
        # model holding this module), torch rebuilt their int8 tensors through APIs it warns are deprecated
        # (TypedStorage, quantized tensor creation), two warnings on every load that ask nothing of the user.
        return {**super().__getstate__(), "_packed": self._packed_bytes()}

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("_packed"), bytes):
            state = {**state, "_packed": _unpacked(state["_packed"], state.get("engine"))}
        super().__setstate__(state)
        if self.reduce_range is False and not has_avx512_vnni():
            warnings.warn(f"{type(self).__name__}: this int8 model was built with 8-bit activations on a CPU with "
                          "AVX512-VNNI; this CPU adds int8 products in int16, where 8 bits can saturate, so its "
                          "accuracy here may differ from what was measured. Apply the plan on this machine "
                          "(`autotune apply`) for 7-bit activations.", RuntimeWarning, stacklevel=2)

    def _packed_bytes(self) -> bytes:
        saved = io.BytesIO()
        torch.save(self._packed, saved)
        return saved.getvalue()

    def get_extra_state(self) -> dict[str, Any]:
        """What state_dict() holds beside the float bias: the packed int8 weights (torch.save's bytes, as a uint8
        tensor) and `computed_with`. Without them a model rebuilt with the plan took a tuned one's state_dict in a
        strict load_state_dict, every key matched, and its int8 modules kept the weights they were built from."""
        packed = torch.frombuffer(bytearray(self._packed_bytes()), dtype=torch.uint8)
        return {"packed": packed, **{name: getattr(self, name) for name in self.computed_with}}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._packed = _unpacked(state["packed"].numpy().tobytes(), self.engine)
        for name in self.computed_with:
            setattr(self, name, state[name])
        self.__dict__.pop("_float_weight", None)    # PackedInt8.weight's, read from the packed weights replaced

    def weight_nbytes(self) -> int:
        return self._nbytes


def _unpacked(saved: bytes, engine: str | None) -> torch.ScriptObject | list[torch.ScriptObject]:
    """Packed weights from torch.save's bytes, packed again by `engine` (this machine's, where it lacks that one)."""
    if engine not in torch.backends.quantized.supported_engines:   # saved before engines were kept
        engine = torch.backends.quantized.engine
    with warnings.catch_warnings(), quantized_engine(engine):
        warnings.simplefilter("ignore", UserWarning)
        return torch.load(io.BytesIO(saved), weights_only=False)


class PackedInt8(Int8Kernels):
    """Holds one module's packed weights.

    `weight` reads as the float tensor the int8 one stands for, dequantised on first read and then kept: parents
    read their children's (`self.wo.weight.dtype` in T5, a tied use). `bias` is the float bias, a frozen
    parameter beside the kernels' own copy, so a model whose every parametrised module is int8 still has
    parameters (eval code takes its device from `next(model.parameters())`). Both are in the dtype the module
    was given in (`float_dtype`): a model handed over in bf16 casts its hidden states to a child's weight dtype,
    and transformers reads the model's dtype off its first parameter. `weight_nbytes` counts the int8 weights and
    their scales; the bias counts as a parameter."""

    _packed: torch.ScriptObject
    float_dtype: torch.dtype = torch.float32    # the default of one saved before it was kept

    def _keep(self, qweight: torch.Tensor, bias: torch.Tensor | None, float_dtype: torch.dtype) -> None:
        """Registers the float bias, in the module's own dtype, and counts the int8 weight's bytes (after packing
        them)."""
        self.float_dtype = float_dtype
        self.register_parameter("bias", None if bias is None
                                else nn.Parameter(bias.to(float_dtype, copy=True), requires_grad=False))
        self._nbytes = qint8_nbytes(qweight, None)

    def _unpack(self) -> torch.Tensor:
        """The int8 weight out of the packed weights."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        if "_float_weight" not in self.__dict__:
            self._dequantize_weight()
        return self.__dict__["_float_weight"]

    # Run eagerly under torch.compile: dynamo has no fake kernel for packed weights, and a parent reading the weight
    # in a compiled forward (HF ViT reads its patch projection's `weight.dtype`) logged "Encountered exception
    # (quantized nyi in meta tensors) during fake tensor propagation" at the first call of each graph.
    @torch.compiler.disable
    def _dequantize_weight(self) -> None:
        self.__dict__["_float_weight"] = self._unpack().dequantize().to(self.float_dtype)
