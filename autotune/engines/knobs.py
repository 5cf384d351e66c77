"""Model-level knobs: whole-model changes that may make a plan run faster. They are tried on the finalists,
beside the engines, and kept only where the re-timing says so; like every finalist, one is re-evaluated before it
can win: autocast and tf32 change the numerics, fold_bn the weights an int8 module quantises, while
channels_last and cuda_graphs keep every value to rounding (`keeps_values`). Each has the shape of a technique:
`supports(model)` says why it does not apply (None: it does), `apply(model)` returns a new model, the given one
untouched, its module names unchanged (a plan is applied by module name after its knobs)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from autotune.clone import clone
from autotune.engines.base import COMPILE_MODE, hooks_on_it_unsaved
from autotune.engines.fold_bn import fold_batchnorms, foldable_pairs
from autotune.engines.lowp import LOW
from autotune.tree import map_tensors

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# The module types whose whole compute a knob running matmuls in a low dtype (`runs_in`: autocast) runs in it: a
# Linear or a convolution is its matmul and bias (autocast keeps softmax and norms in fp32, so not attention or a norm).
MATMUL_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d)


class Knob(Protocol):
    name: str
    engines: ClassVar[tuple[str, ...] | None]    # the engines it has an effect in; None: every engine
    # Whether it leaves every value the model computes as it was, to rounding (a memory layout, a replay of the same
    # kernels): a finalist with it then scores as the one without it does (verified_winner evaluates one of them).
    keeps_values: ClassVar[bool]
    # The module types whose time it can change, where that is all it changes (a convolution's layout); () where it
    # reaches the whole model. The tuner tries it only where those take a share of the timed modules' fp32 time
    # that the finalists' race could tell apart.
    acts_on: ClassVar[tuple[type[nn.Module], ...]]

    def supports(self, model: nn.Module) -> str | None:
        """Why this knob does nothing for `model`, or None where it applies."""

    def runs_in(self, model: nn.Module) -> str | None:
        """The plan dtype (e.g. "bf16") the knob runs `model`'s matmuls in, None where it keeps their dtype: the
        tuner does not try it where the study measured that dtype far slower than fp32."""

    def apply(self, model: nn.Module) -> nn.Module:
        """A new model with the knob set (the fp32 model, before a plan is realised on it).

        Raises:
            Exception: whatever the underlying tool raises where it cannot handle the model.
        """


@dataclass(frozen=True)
class ChannelsLast:
    """4-d weights and activations in NHWC, the layout oneDNN's convolutions prefer on CPU."""
    name: str = "channels_last"
    engines: ClassVar[tuple[str, ...] | None] = None
    keeps_values: ClassVar[bool] = True
    acts_on: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv2d,)

    def supports(self, model: nn.Module) -> str | None:
        return None if any(isinstance(m, nn.Conv2d) for m in model.modules()) else "the model has no Conv2d"

    def runs_in(self, model: nn.Module) -> str | None:
        return None

    def apply(self, model: nn.Module) -> nn.Module:
        # Each 4-d tensor only: Module.to(memory_format=) takes 5-d ones too and fails on them ("required rank 4
        # tensor"; a Conv3d's weights, a capsule net's routing weights beside its Conv2d). `to`, not `contiguous`:
        # a weight of one input channel counts as channels_last already and `contiguous` leaves its strides NCHW's,
        # so cuDNN ran a grayscale stem in NCHW and converted layouts behind it (the knob's gain on an MNIST CNN
        # fell from 1.3x to 1.07x on an H200).
        changed = clone(model)
        for tensor in (*changed.parameters(), *changed.buffers()):
            if tensor.dim() == 4:
                tensor.data = tensor.data.to(memory_format=torch.channels_last)
        return changed


@dataclass(frozen=True)
class FoldBatchNorm:
    """Each BatchNorm that follows a convolution or Linear folded into its weights (inference only). Not in the
    compiled engine, which folds them already (pt2e's prepare fuses each convolution or Linear with its BatchNorm):
    there the knob cost a compile (7-10 s on a MobileNet) for a finalist that raced no faster."""
    name: str = "fold_bn"
    engines: ClassVar[tuple[str, ...] | None] = ("eager", "inductor", "lowp")
    keeps_values: ClassVar[bool] = False
    acts_on: ClassVar[tuple[type[nn.Module], ...]] = ()

    def supports(self, model: nn.Module) -> str | None:
        if not any(isinstance(m, BATCH_NORMS) for m in model.modules()):
            return "the model has no BatchNorm"
        if not foldable_pairs(model):
            return ("no BatchNorm alone reads a convolution's or Linear's output in the modules torch.fx can trace "
                    "(each child is traced apart where the whole model cannot be)")
        return None

    def runs_in(self, model: nn.Module) -> str | None:
        return None

    def apply(self, model: nn.Module) -> nn.Module:
        return fold_batchnorms(clone(model).eval())


def device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters (else buffers) are; the CPU for a model with neither."""
    tensor = next(iter(model.parameters()), None)
    tensor = tensor if tensor is not None else next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


# Scoped settings around the model's forward: a pre-hook enters them, a hook run even when forward raises
# (always_call) leaves them, with what to restore kept on a list both hooks share. Hooks keep the module names and
# the model's class; built from functools.partial over module-level functions they survive clone, torch.save /
# torch.load and torch.compile. torch.compiler.disable runs them eagerly at their place in the call, so the
# compiled graph between them is traced and runs with the settings on, as under an enclosing `with` block.
@torch.compiler.disable
def _enter(enter: Callable[[], Any], tokens: list, module: nn.Module, args: tuple) -> None:
    tokens.append(enter())


@torch.compiler.disable
def _leave(leave: Callable[[Any], None], tokens: list, module: nn.Module, args: tuple, output: Any) -> None:
    if tokens:   # none where a pre-hook before `_enter` raised (a user's, or dynamo's guard in it): nothing to leave
        leave(tokens.pop())


def around_forward(model: nn.Module, enter: Callable[[], Any], leave: Callable[[Any], None]) -> None:
    """`enter()` before each call of `model`, `leave(what enter returned)` after it, even if the call raised."""
    tokens: list = []
    model.register_forward_pre_hook(functools.partial(_enter, enter, tokens))
    model.register_forward_hook(functools.partial(_leave, leave, tokens), always_call=True)


def _autocast_on(device_type: str, dtype: torch.dtype) -> torch.autocast:
    context = torch.autocast(device_type, dtype=dtype)
    context.__enter__()
    return context


def _autocast_off(context: torch.autocast) -> None:
    context.__exit__(None, None, None)


def _float32_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
    return map_tensors(output, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t)


@dataclass(frozen=True)
class Autocast:
    """The model's forward under `torch.autocast` (AMP): fp16 on CUDA, bf16 elsewhere; autocast picks the dtype per
    op (matmuls and convolutions low, reductions and softmax in fp32). Half-precision outputs are cast back to
    fp32, as a plan's are. It changes the numerics, so it is kept only where its re-evaluation passes. Tried in
    the engines that run the plan's modules as they are (eager, inductor): lowp already runs the whole model in
    the low dtype, and pt2e realises int8 through export."""
    name: str = "autocast"
    engines: ClassVar[tuple[str, ...] | None] = ("eager", "inductor")
    keeps_values: ClassVar[bool] = False
    acts_on: ClassVar[tuple[type[nn.Module], ...]] = ()

    def supports(self, model: nn.Module) -> str | None:
        device = device_of(model)
        if not torch.amp.is_autocast_available(device.type):
            return f"torch.autocast does not run on {device.type}"
        return hooks_on_it_unsaved(model)

    def runs_in(self, model: nn.Module) -> str | None:
        return "fp16" if device_of(model).type == "cuda" else "bf16"

    def apply(self, model: nn.Module) -> nn.Module:
        model = clone(model)
        device = device_of(model)
        model.register_forward_hook(_float32_outputs)    # registered first: runs while autocast is still on
        around_forward(model, functools.partial(_autocast_on, device.type, LOW[self.runs_in(model)]), _autocast_off)
        return model


def _tf32_on() -> tuple[bool, bool]:
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return previous


def _tf32_off(previous: tuple[bool, bool]) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@dataclass(frozen=True)
class TF32:
    """fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation) while this
    model runs, and only then: the flags are process-wide, so they are set around its forward and restored after
    it, leaving the fp32 reference and every other model in the process as they were."""
    name: str = "tf32"
    engines: ClassVar[tuple[str, ...] | None] = None
    keeps_values: ClassVar[bool] = False
    acts_on: ClassVar[tuple[type[nn.Module], ...]] = ()

    def supports(self, model: nn.Module) -> str | None:
        device = device_of(model)
        needs = "TF32 needs a CUDA device with compute capability >= 8.0"
        if device.type != "cuda":
            return f"{needs}; this model is on {device}"
        major, minor = torch.cuda.get_device_capability(device)
        return f"{needs}; {device} has {major}.{minor}" if (major, minor) < (8, 0) else hooks_on_it_unsaved(model)

    def runs_in(self, model: nn.Module) -> str | None:
        return None

    def apply(self, model: nn.Module) -> nn.Module:
        model = clone(model)
        around_forward(model, _tf32_on, _tf32_off)
        return model


@dataclass(frozen=True)
class CudaGraphs:
    """CUDA graphs: the compiling engines compile the model with `mode="reduce-overhead"`, which records each
    shape's kernels once and replays them, so a launch-bound model stops paying the CPU cost of each launch. The
    knob marks the model (engines.base.COMPILE_MODE) and the engines' `runnable` reads the mark. Only engines that
    compile with torch.compile can take it (eager does not compile; pt2e's export drops the mark and is CPU-only)."""
    name: str = "cuda_graphs"
    engines: ClassVar[tuple[str, ...] | None] = ("inductor", "lowp")
    keeps_values: ClassVar[bool] = True
    acts_on: ClassVar[tuple[type[nn.Module], ...]] = ()

    def supports(self, model: nn.Module) -> str | None:
        device = device_of(model)
        return None if device.type == "cuda" else f"CUDA graphs need a CUDA device; this model is on {device}"

    def runs_in(self, model: nn.Module) -> str | None:
        return None

    def apply(self, model: nn.Module) -> nn.Module:
        model = clone(model)
        setattr(model, COMPILE_MODE, "reduce-overhead")
        return model


KNOBS: dict[str, Knob] = {knob.name: knob for knob in (ChannelsLast(), FoldBatchNorm(), Autocast(), TF32(),
                                                        CudaGraphs())}


def with_knobs(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """`model` with the named knobs applied in order (the model itself when there are none)."""
    for name in names:
        model = KNOBS[name].apply(model)
    return model
