"""Model size: the bytes its weights take in memory."""
from __future__ import annotations

import inspect
import itertools

import torch
from torch import nn


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers, a tensor two modules share (tied weights) once; packed kernels report
    their own (`weight_nbytes`), and torch.ao's quantised modules give theirs by `weight()` and `bias()`."""
    total, seen = 0, set()
    for module in model.modules():
        if hasattr(type(module), "weight_nbytes"):   # on the class: a miss on the module costs an exception
            total += module.weight_nbytes()
        elif type(module).__module__.startswith(TORCH_AO_QUANTIZED):
            # A model the user quantised in part (quantize_dynamic): its packed int8 weights were left out.
            total += sum(tensor.nbytes for tensor in _packed(module))
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.nbytes
    return total


TORCH_AO_QUANTIZED = "torch.ao.nn.quantized"


def _packed(module: nn.Module) -> list[torch.Tensor]:
    """The weight and bias a torch.ao quantised module holds packed, read back by its `weight()` and `bias()`."""
    found = []
    for name in ("weight", "bias"):
        if inspect.isfunction(getattr(type(module), name, None)):
            value = getattr(module, name)()
            if isinstance(value, torch.Tensor):
                found.append(value)
    return found
