"""torch.export of a model with its input sizes left free where the model allows it: the graph the compiled engine
quantises, and the graph a compiled-engine model is saved as."""
from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import logging
import sys

import torch
from torch import nn
from torch.export.graph_signature import InputKind, TensorArgument
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from autotune.backends.base import CallInputs
from autotune.engines.base import EngineUnavailable
from autotune.engines.quiet import library_notes_dropped
from autotune.errors import describe
from autotune.model_call import fresh
from autotune.tree import map_tensors, tensors

log = logging.getLogger("autotune")

FreeDims = list[list[int]]   # by input tensor, in the order `tensors` lists them: the dimensions asked to stay free


def export(model: nn.Module, inputs, strict: bool = False,
           batches: list[CallInputs] | None = None) -> torch.export.ExportedProgram:
    """`model` exported on `inputs` with free batch (and other) dimensions (_free_dimensions, which reads `batches`);
    traced in Python (`strict=False`, what transformers' models need) unless `strict` (TorchDynamo).

    A length the model's code fixes is warned of (_say_fixed).

    Raises:
        EngineUnavailable: export failed (e.g. data-dependent control flow), with the first line of its reason.
    """
    args, kwargs = fresh(inputs)    # tracing runs the forward, which may add to a cache in the inputs
    output_types_registered(model)
    spec, free = _free_dimensions(model, args, kwargs, batches)
    exported = _exported(model, args, kwargs, strict, spec)
    if (fixed := _lengths_fixed(exported, tensors((args, kwargs)), free)) and _takes_others(model, args, kwargs, fixed):
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        _say_fixed(fixed, tensors((args, kwargs)), [name for name, value in bound.items() for _ in tensors(value)])
    return exported


def _exported(model: nn.Module, args: tuple, kwargs: dict, strict: bool, spec) -> torch.export.ExportedProgram:
    printed = io.StringIO()    # a failing export prints the graph traced so far: kept for --debug, said if it succeeds
    try:
        with contextlib.redirect_stderr(printed):
            exported = torch.export.export(model, args, kwargs, strict=strict, dynamic_shapes=spec)
    except Exception as exc:   # torch.export raises many kinds; each means this model cannot be exported
        log.debug("torch.export printed before it failed:\n%s", printed.getvalue())
        raise EngineUnavailable(f"torch.export failed: {describe(exc)}") from exc
    sys.stderr.write(printed.getvalue())
    return exported


def _lengths_fixed(exported: torch.export.ExportedProgram, inputs: list[torch.Tensor],
                   free: FreeDims) -> set[tuple[int, int]]:
    """(input tensor, dimension) asked free that the graph fixed, but for a floating-point input's last (its
    features, which its first layer's weights fix)."""
    names = [spec.arg.name for spec in exported.graph_signature.input_specs
             if spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, TensorArgument)]
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    if len(names) != len(inputs):
        return set()
    fixed = set()
    for index, (name, tensor, dims) in enumerate(zip(names, inputs, free)):
        shape = placeholders[name].meta["val"].shape
        features = tensor.dim() - 1 if tensor.is_floating_point() and tensor.dim() > 1 else None
        fixed |= {(index, dim) for dim in dims if dim != features and is_concrete_int(shape[dim])}
    return fixed


def _takes_others(model: nn.Module, args: tuple, kwargs: dict, fixed: set[tuple[int, int]]) -> bool:
    """Whether `model` runs with each `fixed` dimension one shorter: where it does not (a convolution's channels),
    the graph fixed what the model's weights fix."""
    position = itertools.count()

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        index = next(position)
        for dim in (dim for at, dim in fixed if at == index):
            tensor = tensor.narrow(dim, 0, tensor.shape[dim] - 1)
        return tensor
    shorter = map_tensors((args, kwargs), cut)
    try:
        with torch.no_grad():
            model(*shorter[0], **shorter[1])
    except Exception:   # whatever the model raises on sizes it does not take
        return False
    return True


_said_fixed: set[str] = set()


def _say_fixed(fixed: set[tuple[int, int]], inputs: list[torch.Tensor], names: list[str]) -> None:
    """Warns, once per size, that the graph takes one length only. A buffer of the largest length sliced to each
    call's (a causal mask, `mask[:T, :T]`) does it where the example is that long: export then decides the slice is
    the whole buffer (torch 2.13), and traced one shorter, that it is not, refusing the full length instead. So does
    `len(x)` (a ViT's `cls.expand(len(x), -1, -1)`): it returns an int, not a symbol."""
    where = ", ".join(f"`{names[index]}` dimension {dim} at {inputs[index].shape[dim]}" for index, dim in sorted(fixed))
    if where not in _said_fixed:
        _said_fixed.add(where)
        log.warning("compiled engine: export fixed %s, where the model takes other sizes (the model's code fixes "
                    "it: a buffer of that length sliced to the input's, as a causal mask often is, or the size read "
                    "as a Python int, as `len(x)` reads it where `x.shape[0]` would not): its graph takes only "
                    "that size there and raises `Guard failed` at others; the other engines take any", where)


def _free_dimensions(model: nn.Module, args: tuple, kwargs: dict,
                     batches: list[CallInputs] | None = None) -> tuple[dict, FreeDims]:
    """The dimensions of the input tensors left for export to decide (Dim.AUTO: dynamic where the model allows it),
    by parameter name as export needs for keyword inputs; None for what is not a tensor (a float or flag argument).
    With them, the same dimensions by input tensor.

    Without `batches`, every dimension: batches differ in size and, for sequence models, in length. With the captured
    `batches` (the first export of a user's model), an input of up to three dimensions (batch, sequence, features)
    keeps every one free, but a larger one (images, video: N, C, H, W) only its batch and any other dimension that
    differs among `batches`: a deployment keeps its image size, and spatial sizes left free cost export minutes on a
    model that computes with them (a windowed-attention Swin: 160 s where its batch alone took 2 s). A graph exported
    once asserts the sizes it fixed, so exporting it again frees no more than that. Never dimensions of size 0 or 1,
    which export specialises whatever it is told (and warns of each)."""
    def bound(call_args: tuple, call_kwargs: dict) -> dict:
        return dict(inspect.signature(model.forward).bind(*call_args, **call_kwargs).arguments)

    varying = _varying_dimensions([tensors(bound(*batch)) for batch in batches or []])
    if varying is None:   # the batches differ in what they pass: no telling which sizes stay
        batches = None
    free: FreeDims = []

    def to_free(t: torch.Tensor) -> dict | None:
        index = len(free)
        free.append([i for i, n in enumerate(t.shape) if n > 1 and (batches is None or t.dim() <= 3 or i == 0
                                                                    or i in varying.get(index, ()))])
        return {i: torch.export.Dim.AUTO for i in free[-1]} or None

    return map_tensors(bound(args, kwargs), to_free, lambda other: None), free


def _varying_dimensions(batches: list[list[torch.Tensor]]) -> dict[int, set[int]] | None:
    """{tensor position: the dimensions whose size differs among `batches`} (each a list of its input tensors); None
    where the batches differ in their number of tensors or a tensor's number of dimensions."""
    if len({tuple(t.dim() for t in batch) for batch in batches}) > 1:
        return None
    return {index: {i for i in range(same[0].dim()) if len({t.shape[i] for t in same}) > 1}
            for index, same in enumerate(zip(*batches))}


def output_types_registered(model: nn.Module | None = None) -> None:
    """transformers' cache classes (a decoder's DynamicCache, T5's EncoderDecoderCache) known to torch's pytree, as
    transformers' own exporter registers them: export fails on a model returning one (\"Found DynamicCache in output,
    which is not a known type\"), and loading fails on a graph that returns one, unless they are. With `model`, its
    transformers models' own cache classes too. Only where transformers is imported already (loading a graph, and a
    model of transformers, import it), and only with a transformers that has its exporters (5.x)."""
    if "transformers" not in sys.modules:
        return
    try:
        with library_notes_dropped():   # its import can import torchao, which gives some
            from transformers.cache_utils import Cache
            from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model, register_pytree_node
    except ImportError:
        return
    pending = [Cache]
    while pending:
        for cls in pending.pop().__subclasses__():
            register_pytree_node(cls)
            pending.append(cls)
    seen: set[str] = set()
    for module in model.modules() if model is not None else ():
        where = type(module).__module__
        if where.startswith("transformers.") and where not in seen:
            seen.add(where)
            register_cache_pytrees_for_model(module)   # the cache classes its modeling file defines
