"""Compiled int8 graphs run with inductor's `freezing` on: weights fold in as constants, which is when inductor
lowers each quantise / dequantise pair around a convolution or linear into oneDNN's int8 kernels; without it they
run dequantised in fp32 (a residual CNN at batch 32 on an AVX512-VNNI CPU: 8x fp32 eager frozen, 1.5x not)."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autotune.engines import quiet  # noqa: F401  (its process-wide filter of inductor's int8 lowering note)
from autotune.engines.base import compile_model
from autotune.errors import describe
from autotune.tree import map_tensors, tensors

log = logging.getLogger(__name__)


try:   # inductor's `freezing` switch: see _call_frozen
    from torch._inductor import config as _inductor_config
except ImportError:
    _inductor_config = None


@contextmanager
def inductor_passes_kept() -> Iterator[None]:
    """Inductor's process-wide `pre_grad_custom_pass` as it was before the block, whatever the block set (importing
    torchao's quantizer sets it: see pt2e._x86_quantizer)."""
    prior = None if _inductor_config is None else _inductor_config.pre_grad_custom_pass
    try:
        yield
    finally:
        if _inductor_config is not None:
            _inductor_config.pre_grad_custom_pass = prior


STATIC_SHAPES = 8   # shapes a model that cannot be frozen for a dynamic batch is compiled frozen for, each apart


class FrozenCompiled(nn.Module):
    """A converted model under torch.compile, called with inductor's freezing on, so that whatever it compiles,
    for whichever shape, is frozen.

    Some graphs compile frozen for fixed shapes but not for a dynamic batch (torch 2.13: a convolution after
    max-pooling fails a stride check in the quantised-conv lowering, and the broken code stays in the compiled
    module's cache). From the first failure on, a fresh module is compiled frozen for each shape on its own, up to
    STATIC_SHAPES of them; other shapes run compiled without freezing."""

    def __init__(self, built: nn.Module, options: dict[str, Any] | None = None):
        super().__init__()
        self.built = (built,)      # a reference, not a second registration of its parameters
        self.options = options     # inductor's, for every compile of this model
        self.frozen = compile_model(_Calls(built), options=options)
        self.unfrozen: nn.Module | None = None     # set at the first failure, with `frozen` compiled per shape
        self.frozen_shapes: set[tuple] = set()     # (shapes, grad modes) run frozen in `frozen`
        self.kept: set[tuple] = set()              # frozen before the failure: compiled per shape when next called
        self.unfreezable: set[tuple] = set()
        self.taken: set[tuple] = set()             # input shapes the graph itself has run: checked once, eagerly
        self.example = None    # zeros shaped as the first call's inputs: what saving exports the graph on

    def train(self, mode: bool = True) -> FrozenCompiled:
        """Sets the flag alone: the graph runs as it was converted, for inference, in either mode. torch.export's
        graphs refuse train() and eval(), and an eval_fn's evaluate() calls eval() first and often train() last."""
        self.training = mode
        return self

    def forward(self, *args, **kwargs):
        if self.example is None:   # not inference tensors: export would trace them into the plan's fp32 modules
            with torch.inference_mode(False):
                self.example = map_tensors((args, kwargs), torch.zeros_like)
        # Inductor's int8 linear fused with the residual add after it writes the sum into the addend, also where that
        # is an input of the graph (torch 2.13: a transformer layer's first residual): the caller's tensor came back
        # changed, and an eval_fn's data with it. The graph gets copies of the floating-point inputs.
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            args = tuple(a.clone() if a.is_floating_point() else a for a in args)
        else:
            args, kwargs = map_tensors((args, kwargs), _copied_if_floating)
        return self._frozen_call(*args, **kwargs)

    def _frozen_call(self, *args, **kwargs):
        shapes = (tuple((a.shape, a.dtype) for a in args) if not kwargs and all(type(a) is torch.Tensor for a in args)
                  else tuple((t.shape, t.dtype) for t in tensors((args, kwargs))))
        if shapes not in self.taken:
            # Inputs the graph itself refuses raise its error, the caller's, before compiled code sees them:
            # torch.compile's attempt at a 28x28 image for a conv net of 16x16 ones left code that failed every
            # later call at a batch it had run (torch 2.13: "expected size 32==32, stride 1==256").
            self._check_dtypes(args, kwargs)
            self.built[0](*args, **kwargs)
            self.taken.add(shapes)
        # With the grad mode: code compiled for a shape under no_grad is not the code inference_mode runs, and a
        # conv net run in both failed the second's compile at a shape the first had run frozen.
        call = (shapes, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        if self.unfrozen is not None and not self._frozen_per_shape(call):
            return self.unfrozen(*args, **kwargs)
        try:
            out = self._call_frozen(*args, **kwargs)
        except Exception as exc:   # inductor's lowerings raise many kinds
            if call in self.frozen_shapes:
                raise              # it ran frozen before: not a failure to freeze
            self._step_down(call, exc)
            return self(*args, **kwargs)
        self.frozen_shapes.add(call)
        return out

    def _check_dtypes(self, args: tuple, kwargs: dict) -> None:
        """Raises TypeError for floating-point inputs of another dtype than the first call's, as the model handed
        over does: the graph runs an fp16 one, inductor's int8 lowering fails on it, and that failure made the model
        step down to dequantised int8 (2.5x slower) for good."""
        built_for = {t.dtype for t in tensors(self.example) if t.is_floating_point()}
        given = {t.dtype for t in tensors((args, kwargs)) if t.is_floating_point()}
        if built_for and (other := given - built_for):
            raise TypeError(f"this compiled model takes {', '.join(sorted(map(str, built_for)))} inputs, as it was "
                            f"tuned on; got {', '.join(sorted(map(str, other)))}: cast them first")

    def _call_frozen(self, *args, **kwargs):
        """`frozen` called with freezing on, on every call: code compiled for a shape can be dropped (a user's
        `torch.compiler.reset()`) and compiled again at any call. Through inductor's config module: dynamo reads the
        switch there only (torch.compile(options={"freezing": True}) reaches inductor alone, and these graphs then
        fail to compile in torch 2.13: UnsupportedOperatorException onednn.qconv_prepack); the x86 pt2e tutorial
        sets it there. Set and restored directly: `config.patch` costs 20 us a call, 13 % of MNISTNet's at batch 1.
        Without the module the graph runs compiled unfrozen."""
        if _inductor_config is None:
            return self.frozen(*args, **kwargs)
        prior = _inductor_config.freezing     # the calling thread's: inductor's config is per thread
        _inductor_config.freezing = True
        try:
            return self.frozen(*args, **kwargs)
        finally:
            _inductor_config.freezing = prior

    def _frozen_per_shape(self, call: tuple) -> bool:
        return call not in self.unfreezable and (call in self.kept
                                                 or len(self.frozen_shapes | self.kept) < STATIC_SHAPES)

    def _step_down(self, call: tuple, exc: Exception) -> None:
        if self.unfrozen is not None:
            self.unfreezable.add(call)
            return
        # INFO: it is said at a call, in a process serving a saved model too, where nothing can be done of it.
        log.info("compiled engine: inductor cannot freeze this model for a dynamic batch (input shapes %s: %s); it is "
                 "compiled frozen for each shape apart, up to %d, and without freezing (int8 kernels dequantised) for "
                 "others", list(call[0]), describe(exc), STATIC_SHAPES)
        self.kept, self.frozen_shapes = self.frozen_shapes, set()
        self.frozen = compile_model(_Calls(self.built[0]), dynamic=False, options=self.options)
        self.unfrozen = compile_model(_Calls(self.built[0]), options=self.options)


_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def sums_kept_out_of_constants(model: nn.Module) -> None:
    """Where `model` is a graph, each of its additions of a tensor it computes from its weights, buffers and input
    shapes alone to a tensor computed from its inputs, of the same shape, written a - (-c), which is exactly a + c.
    Frozen, inductor folds such a tensor into a constant, and its int8 linear fused with the add after it writes the
    sum into that constant, in place: each call added to it again (torch 2.13: RoCBert's embeddings add token-type
    embeddings of a buffer to a linear's output; its outputs were 30 % of their scale off by the third call, and its
    top-1 agreement with fp32 fell from 100 % to 45 % over 8 batches). Inductor fuses no subtraction into a linear."""
    if not isinstance(model, torch.fx.GraphModule):
        return
    graph, fixed = model.graph, set()
    for node in graph.nodes:
        if node.op == "get_attr" or (node.op == "call_function" and (
                node.target is torch.ops.aten.sym_size.int or all(n in fixed for n in node.all_input_nodes))):
            fixed.add(node)
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ADDS or node.kwargs or len(node.args) != 2:
            continue
        computed, constant = node.args
        if node.target is torch.ops.aten.add.Tensor and isinstance(computed, torch.fx.Node) and computed in fixed:
            computed, constant = constant, computed
        if not (isinstance(computed, torch.fx.Node) and isinstance(constant, torch.fx.Node)
                and constant in fixed and computed not in fixed and _same_shape(computed, constant)):
            continue
        if node.target is torch.ops.aten.add_.Tensor and len(computed.users) > 1:
            continue     # others read the tensor it adds into: a - (-c) would leave it as it was for them
        with graph.inserting_before(node):
            negated = graph.call_function(torch.ops.aten.neg.default, (constant,))
            difference = graph.call_function(torch.ops.aten.sub.Tensor, (computed, negated))
        negated.meta, difference.meta = dict(constant.meta), dict(node.meta)
        node.replace_all_uses_with(difference)
        graph.erase_node(node)
        changed = True
    if changed:
        model.recompile()


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    shapes = [getattr(n.meta.get("val"), "shape", None) for n in (a, b)]
    return shapes[0] is not None and shapes[0] == shapes[1]


def _copied_if_floating(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.is_floating_point() else tensor


class _Calls(nn.Module):
    """Calls `built`: each compiled wrapper has a forward of its own to compile, apart from the other's."""

    def __init__(self, built: nn.Module):
        super().__init__()
        self.built = built

    def forward(self, *args, **kwargs):
        return self.built(*args, **kwargs)
