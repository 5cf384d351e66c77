"""Model size: the bytes its weights take in memory."""
from __future__ import annotations

import itertools

from torch import nn


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers, a tensor two modules share (tied weights) once; packed kernels report
    their own (`weight_nbytes`)."""
    total, seen = 0, set()
    for module in model.modules():
        if hasattr(type(module), "weight_nbytes"):   # on the class: a miss on the module costs an exception
            total += module.weight_nbytes()
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.nbytes
    return total
