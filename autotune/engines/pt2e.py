"""The compiled engine: PyTorch 2 export quantisation (torchao's X86InductorQuantizer) realises the plan's int8
modules with static activation ranges calibrated on several real batches, leaves its fp32 modules out of the
quantizer, and inductor compiles the result so that quantise / dequantise pairs fuse into int8 kernels."""
from __future__ import annotations

import importlib
import io
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.backends.int8_attention import ProjectedAttention, is_packed_attention
from autotune.backends.int8_conv import Conv1dAsConv2d
from autotune.backends.int8_linear import conv1d_as_linear, is_gpt_conv1d, linear_on
from autotune.backends.quantized import explicit_padding, plain_type, resolve_reduce_range
from autotune.clone import clone
from autotune.engines.base import Calibration, EngineUnavailable
from autotune.engines.export import export, output_types_registered
from autotune.engines.frozen import FrozenCompiled, inductor_passes_kept, sums_kept_out_of_constants
from autotune.engines.quiet import library_notes_dropped
from autotune.engines.saved_graph import CallLayout, read_graph, write_graph
from autotune.errors import describe
from autotune.fused_paths import calls_children_as_modules
from autotune.model_call import call
from autotune.plan import Plan

log = logging.getLogger("autotune")

REALISED = {"int8", "fp32"}
QUANTISED = (nn.Linear, nn.Conv2d)   # the module types whose int8 the quantizer realises as they are
WEIGHTED_OPS = ("linear", "conv1d", "conv2d", "conv3d", "convolution")   # their ops in an exported graph


def _prepared(fp32: nn.Module, batches: list[CallInputs], quantizer) -> nn.Module:
    """The model exported on the first of `batches` and prepared for calibration. A graph traced in Python does not
    tell one call of a module from another, so a module called twice (one nn.ReLU after both convolutions of a ResNet
    block, as torchvision's are) becomes one partition with two outputs, which the quantizer rejects; TorchDynamo's
    graph names each call, so that is tried where the first fails.

    Raises:
        EngineUnavailable: the model cannot be exported, or neither graph annotated; the first failure's reason.
    """
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
    batches = [CallLayout.of(fp32, batch).arrange(*batch) for batch in batches]    # keywords in signature order
    traced = export(fp32, batches[0], batches=batches)
    try:
        return _integers_unobserved(prepare_pt2e(traced.module(), quantizer))
    except Exception as exc:   # torchao raises many kinds for graphs its patterns do not fit
        first = EngineUnavailable(f"torchao's X86InductorQuantizer cannot annotate the model: {describe(exc)}")
    try:
        return _integers_unobserved(prepare_pt2e(export(fp32, batches[0], strict=True, batches=batches).module(),
                                                 quantizer))
    except Exception:
        raise first from None


def _integers_unobserved(prepared: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`prepared` without the observers the quantizer put on integer tensors: it annotates a multiplication's
    inputs whatever their dtype, and DeBERTa's relative positions multiply an int64 `sign` (calibration then failed:
    "histogram_cpu" not implemented for 'Long', and the engine was dropped). Such an input stays as it is."""
    from torchao.quantization.pt2e import ObserverBase
    for node in list(prepared.graph.nodes):
        if node.op != "call_module" or not isinstance(prepared.get_submodule(node.target), ObserverBase):
            continue
        value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            node.replace_all_uses_with(node.args[0])
            prepared.graph.erase_node(node)
    prepared.recompile()
    return prepared


def _left_in_fp32(converted: torch.fx.GraphModule, plan: Plan) -> list[str]:
    """The plan's int8 modules none of whose linears and convolutions in the converted graph reads a dequantised
    weight: the quantizer annotates what its patterns match, and says nothing of a module they missed."""
    int8 = [name for name, dtype in plan.items() if dtype == "int8"]
    seen, quantised = set(), set()
    for node in converted.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack or len(node.args) < 2 or not any(
                kind in str(node.target) for kind in WEIGHTED_OPS):
            continue
        path = list(stack.values())[-1][0]
        owner = next((name for name in int8 if path == name or path.startswith(f"{name}.")), None)
        if owner is not None:
            seen.add(owner)
            weight = node.args[1]
            if isinstance(weight, torch.fx.Node) and "dequantize" in str(weight.target):
                quantised.add(owner)
    return sorted(seen - quantised)


def _ready_to_quantise(fp32: nn.Module, plan: Plan, as_conv2d: Sequence[str] = ()) -> nn.Module:
    """`fp32`, or a copy of it where the modules are what the quantizer realises right: the plan's int8 GPT-style
    Conv1D (GPT-2's projections, an addmm it has no pattern for) as the nn.Linear it computes, under its name; its
    int8 nn.MultiheadAttention as the ProjectedAttention calling its projections as nn.Linear modules (the
    quantizer finds linears by the module or function they came from, and torch's attention's come from the
    attention itself: no pattern matched them), with the fused paths above it off; an int8 Linear that runs
    Linear's forward as a plain nn.Linear (a subclass, or one with a parametrized weight, is no module the quantizer
    matches), on a weight of its own where it was a strided view (a transposed tied weight: inductor's frozen int8
    linear read such a view wrongly, torch 2.13: outputs 120 % off); the Conv1d modules named in `as_conv2d` as
    the Conv2d of height 1 each equals (Conv1dAsConv2d); and any convolution padded "same" or "valid" with that
    padding as numbers (see _numeric_padding)."""
    def needs_change(module: nn.Module) -> bool:
        return is_gpt_conv1d(module) or is_packed_attention(module) or _unplain_linear(module)

    names = [n for n, dtype in plan.items() if dtype == "int8" and needs_change(fp32.get_submodule(n))]
    names += as_conv2d
    padded = [n for n, module in fp32.named_modules() if _numeric_padding(module) is not None]
    if not names and not padded:
        return fp32
    model = clone(fp32)
    for name in names:
        module = model.get_submodule(name)
        if is_gpt_conv1d(module):
            model.set_submodule(name, conv1d_as_linear(module))
        elif name in as_conv2d:
            model.set_submodule(name, Conv1dAsConv2d(module))
        elif is_packed_attention(module):
            model.set_submodule(name, ProjectedAttention(module, lambda linear: linear))
        else:
            model.set_submodule(name, linear_on(module.weight.detach().contiguous(),
                                                None if module.bias is None else module.bias.detach()))
    for name in padded:
        module = model.get_submodule(name)
        module.padding = _numeric_padding(module)
    calls_children_as_modules(model, names)
    return model


def _plain_conv1d(module: nn.Module) -> bool:
    """An nn.Conv1d padded with zeros, the same on both sides: the quantizer annotates it where an nn.ReLU module
    follows it, and else computed as the Conv2d of height 1 it equals (slower: 4.6x fp32 where the first ran
    6.5x, a Conv1d audio front at batch 64)."""
    return (isinstance(module, nn.Conv1d) and plain_type(module).forward is nn.Conv1d.forward
            and module.padding_mode == "zeros" and explicit_padding(module) is not None)


def _unplain_linear(module: nn.Module) -> bool:
    """An nn.Linear computing Linear's forward that the quantizer would miss (not of type nn.Linear itself) or
    realise wrongly (its weight a strided view)."""
    return (isinstance(module, nn.Linear) and plain_type(module).forward is nn.Linear.forward
            and (type(module) is not nn.Linear or not module.weight.is_contiguous()))


def _numeric_padding(module: nn.Module) -> tuple[int, ...] | None:
    """For a convolution padded "same" or "valid" with zeros, where that is the same on both sides of each
    dimension, the padding as numbers: it computes the same, and exports as aten.convNd rather than
    aten.convNd.padding, which the quantizer's patterns do not match (its annotation then failed for the whole
    model, whichever modules a plan lowers). None for any other module."""
    if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or not isinstance(module.padding, str) \
            or module.padding_mode != "zeros":
        return None
    return explicit_padding(module)


def _without_unread_tensors(converted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`converted` without the parameters and buffers its graph no longer reads: convert_pt2e keeps each quantised
    module's fp32 weight beside the int8 one it computes with, so the model would hold and save both (MNISTNet: 2.0
    MiB where fp32 alone is 1.6)."""
    read = {str(node.target) for node in converted.graph.nodes if node.op == "get_attr"}
    for name in [n for n, _ in [*converted.named_parameters(), *converted.named_buffers()] if n not in read]:
        owner, _, leaf = name.rpartition(".")
        delattr(converted.get_submodule(owner), leaf)
    converted.delete_all_unused_submodules()
    return converted


def _converted(fp32: nn.Module, plan: Plan, calibration: Calibration, as_conv2d: Sequence[str] = ()) -> nn.Module:
    """The plan's int8 modules quantised by torchao's X86InductorQuantizer, calibrated on `calibration`'s batches
    (the Conv1d modules in `as_conv2d` as the Conv2d each equals; see _ready_to_quantise)."""
    xiq = _x86_quantizer()
    with library_notes_dropped():   # torchao's import gives some
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e
    fp32 = _ready_to_quantise(fp32, plan, as_conv2d)
    quantizer = xiq.X86InductorQuantizer()
    # 7-bit activations where the CPU lacks VNNI, as torchao advises: oneDNN's int8 kernels saturate with 8 there
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config(
        is_dynamic=False, reduce_range=resolve_reduce_range(None)))
    for name, dtype in plan.items():
        if dtype == "fp32":
            quantizer.set_module_name_qconfig(name, None)
    with warnings.catch_warnings(), library_notes_dropped():
        warnings.simplefilter("ignore")      # torchao warns of APIs it will change, on every call
        prepared = _prepared(fp32, calibration.batches, quantizer)
        with torch.no_grad():
            call(prepared, calibration.batches[0])
            for index, batch in enumerate(calibration.batches[1:], 1):
                try:
                    call(prepared, batch)
                except Exception as exc:  # noqa: BLE001 - a size the graph fixed (a `len(x)`): its ranges go
                    log.info("calibration batch %d is left out: the graph exported on the first refuses it (%s)",
                             index, describe(exc, 160))
        converted = _without_unread_tensors(convert_pt2e(prepared))
    sums_kept_out_of_constants(converted)    # in what is saved too: whoever compiles it freezes it
    return converted


@dataclass(frozen=True)
class CompiledEngine:
    name: str = "compiled"
    keeps_model: bool = False   # an exported graph: the model's methods are not on it
    lowers_unplanned: bool = False
    compiles_static_when_marked: bool = False   # frozen.py compiles per shape where a dynamic batch fails
    calibrates_on_batches: bool = True

    def unsupported(self, plan: Plan, fp32: nn.Module) -> str | None:
        other = sorted(set(plan.values()) - REALISED)
        if other:
            return f"the compiled engine realises int8 and fp32 only, not {other}"
        if "int8" not in plan.values():
            return "the plan keeps every module in fp32"
        for name in (n for n, dtype in plan.items() if dtype == "int8"):
            module = fp32.get_submodule(name)
            if not (isinstance(module, QUANTISED) or _plain_conv1d(module) or is_gpt_conv1d(module)
                    or is_packed_attention(module)):
                return (f"the compiled engine quantises nn.Linear, nn.Conv2d, nn.Conv1d padded with zeros, GPT-style "
                        f"Conv1D and nn.MultiheadAttention only, not {type(module).__name__} ({name})")
        return None

    def build(self, fp32: nn.Module, plan: Plan, calibration: Calibration) -> nn.Module:
        where = {t.device.type for t in (*fp32.parameters(), *fp32.buffers())} - {"cpu"}
        if where:
            raise EngineUnavailable(f"the compiled engine's int8 kernels run on x86 CPUs, not on {sorted(where)[0]}")
        if reason := self.unsupported(plan, fp32):
            raise EngineUnavailable(reason)
        converted = _converted(fp32, plan, calibration)
        left = _left_in_fp32(converted, plan)
        if as_conv2d := [name for name in left if _plain_conv1d(fp32.get_submodule(name))]:
            converted = _converted(fp32, plan, calibration, as_conv2d)
            left = _left_in_fp32(converted, plan)
        if left:
            raise EngineUnavailable(f"the quantizer matched no pattern in {', '.join(left)}, which the plan puts in "
                                    "int8: the plan would run, labelled int8, with those modules in fp32")
        return converted

    def runnable(self, built: nn.Module) -> nn.Module:
        return SavedAsExported(built)

    # Through file objects: torch.export warns of any path not ending in .pt2 (the cache's names do not).
    def save(self, built: nn.Module, inputs, path: str) -> str:
        with open(path, "wb") as out:
            layout = write_graph(built, inputs, out)
        copies = (" on copies of the inputs you keep (its int8 linear fused with a residual add can write the sum "
                  "into an input)" if _may_hold_linear(built) else "")
        return ("import torchao.quantization.pt2e.quantize_pt2e (it registers the int8 ops), then "
                "torch.compile(torch.export.load(path).module(), dynamic=False), called with "
                "torch._inductor.config.freezing = True (inductor then runs int8 kernels; it cannot freeze some such "
                f"graphs for a dynamic batch, so each batch size compiles apart){copies}, as eval_fn called the "
                f"model: ({layout})")

    def load(self, path: str) -> nn.Module:
        quantised_ops_registered()
        output_types_registered()
        with open(path, "rb") as saved:
            return _graph_read(saved)


def _graph_read(saved) -> nn.Module:
    """The graph `write_graph` wrote, with its adds of folded constants written as the build writes them (a graph
    saved before the build did so: see frozen.sums_kept_out_of_constants)."""
    graph = read_graph(saved)
    sums_kept_out_of_constants(graph)
    return graph


def _may_hold_linear(built: nn.Module) -> bool:
    """Whether the converted graph calls a linear (where it is no graph: whether it may)."""
    graph = getattr(built, "graph", None)
    if not isinstance(graph, torch.fx.Graph):
        return True
    return any(node.op == "call_function" and node.target is torch.ops.aten.linear.default for node in graph.nodes)


class SavedAsExported(FrozenCompiled):
    """The engine's model as it runs. Saved (torch.save, pickle, copy.deepcopy) as its graph exported on zeros shaped
    as its first call's inputs (the graph of a converted model does not pickle), and compiled again where it is next
    called: compiled code is made for the machine it runs on. Compiled with the pre-grad pass torchao gives the
    graphs of its X86InductorQuantizer (see _x86_quantizer), in the tuning process and in any other alike."""

    def __init__(self, built: nn.Module):
        with library_notes_dropped():   # torchao's import gives some
            from torchao.quantization.pt2e.inductor_passes.x86 import quant_lift_up
        super().__init__(built, options={"pre_grad_custom_pass": quant_lift_up})
        self.output_modules: list[str] = []   # where the classes of its first output are defined
        self.layout = CallLayout.of(built)

    def forward(self, *args, **kwargs):
        args, kwargs = self.layout.arrange(args, kwargs)
        first = self.example is None
        output = super().forward(*args, **kwargs)
        if first:
            self.output_modules = sorted(_defining_modules(output))
        return output

    def __reduce__(self):
        if self.example is None:
            raise TypeError("a compiled-engine model is saved once it has been called: its graph is exported on "
                            "inputs shaped as its first call's")
        exported = io.BytesIO()
        write_graph(self.built[0], self.example, exported)
        return _loaded, (exported.getvalue(), self.example, self.output_modules)


def _defining_modules(output) -> set[str]:
    """The modules defining the containers in a model's `output` (transformers' ModelOutput and cache classes): a
    process loading the graph imports them, so that they are registered as pytree nodes, as they were here."""
    if isinstance(output, (torch.Tensor, int, float, bool, str, type(None))):
        return set()
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    return {type(output).__module__, *(name for item in items for name in _defining_modules(item))} - {"builtins"}


def _x86_quantizer():
    """torchao's X86InductorQuantizer module, imported with inductor's config left as it was. Importing it sets the
    process's `pre_grad_custom_pass` to torchao's pass for every later torch.compile, and a compiled model saves a
    copy of that config: the inductor and lowp engines' models (and a user's own) then named torchao's pass, and
    loading them imported torchao, printing its CUDA notes. The graphs that pass is for get it as an option."""
    with library_notes_dropped(), inductor_passes_kept():   # torchao's import gives some notes
        from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer
    return x86_inductor_quantizer


def quantised_ops_registered() -> None:
    """Registers the quantise / dequantise ops an exported int8 graph calls (torch.ops.quantized_decomposed), as
    importing torchao's pt2e does: a process that did not quantise cannot load such a graph before."""
    with library_notes_dropped():   # torchao's import gives some
        import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401


def _loaded(exported: bytes, example, output_modules: list[str] = ()) -> SavedAsExported:
    quantised_ops_registered()
    with library_notes_dropped():   # transformers' import can import torchao, which gives some
        for name in output_modules:
            importlib.import_module(name)
    output_types_registered()
    runnable = SavedAsExported(_graph_read(io.BytesIO(exported)))
    runnable.example = example
    return runnable
