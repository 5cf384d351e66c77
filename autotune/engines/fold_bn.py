"""BatchNorms folded into the convolution or Linear before them, in the model's own module tree: the model keeps
its class, its methods and every hook (torch.fx's `fuse` returned a GraphModule instead, whose pickling drops the
hooks set on it: the lowp engine's casts were lost when such a tuned model was saved and loaded)."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

from autotune.backends.base import forward_hooks

# The pairs torch.fx's `fuse` folds: a layer and the BatchNorm over its output channels.
FOLDABLE = ((nn.Conv1d, nn.BatchNorm1d), (nn.Conv2d, nn.BatchNorm2d), (nn.Conv3d, nn.BatchNorm3d),
            (nn.Linear, nn.BatchNorm1d))


def fold_batchnorms(model: nn.Module) -> nn.Module:
    """Folds, in place, each BatchNorm (eval mode, running statistics) that alone reads the output of a convolution
    or Linear, each called once per forward of the module traced and neither hooked (a hook would see other values);
    the BatchNorm becomes an Identity, so module names stay. Returns `model`."""
    for layer_name, norm_name in foldable_pairs(model):
        layer, norm = model.get_submodule(layer_name), model.get_submodule(norm_name)
        fold = fuse_linear_bn_eval if isinstance(layer, nn.Linear) else fuse_conv_bn_eval
        model.set_submodule(layer_name, fold(layer, norm))
        model.set_submodule(norm_name, nn.Identity())
    return model


def foldable_pairs(model: nn.Module, prefix: str = "") -> list[tuple[str, str]]:
    """(layer, BatchNorm) module names to fold. torch.fx traces the model; where it cannot (data-dependent control
    flow: every transformers model), each child is traced apart, down the tree, and pairs are found within the
    children it can trace (a transformers ResNet's conv layers: convolution, BatchNorm, activation)."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:   # whatever the tracer raises on the model's code
        return [pair for name, child in model.named_children() for pair in foldable_pairs(child, f"{prefix}{name}.")]
    modules = dict(model.named_modules())
    calls = [node for node in graph.nodes if node.op == "call_module"]
    times_called = Counter(node.target for node in calls)
    pairs = []
    for node in calls:
        source = node.args[0] if node.args else None
        if not isinstance(source, torch.fx.Node) or source.op != "call_module" or len(source.users) != 1:
            continue
        layer, norm = modules[source.target], modules[node.target]
        if (any(type(layer) is a and type(norm) is b for a, b in FOLDABLE) and norm.track_running_stats
                and norm.running_mean is not None and times_called[source.target] == times_called[node.target] == 1
                and not any(forward_hooks(m, kind) for m in (layer, norm) for kind in ("", "_pre"))):
            pairs.append((prefix + source.target, prefix + node.target))
    return pairs
