"""int8 LSTM and GRU with dynamic activation quantisation: each layer's input-to-hidden and hidden-to-hidden
weights in per-channel int8, activations quantised per step (no calibration needed), through FBGEMM's quantized
RNN kernels (the aten ops torch.ao's dynamic RNN modules call)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from autotune.backends.base import CallInputs, Technique
from autotune.backends.quantized import (
    Int8Kernels,
    engine_available,
    per_channel_qweight,
    plain_type,
    qint8_nbytes,
    quantized_engine,
    resolve_reduce_range,
)

RNN_TYPES = (nn.LSTM, nn.GRU)


class DynamicInt8RNN(Int8Kernels):
    """An `nn.LSTM` or `nn.GRU` (inference only) running int8 weights; called and answering as the module it
    replaces: tensor or PackedSequence input, optional initial state, batched or not."""

    def __init__(self, rnn: nn.LSTM | nn.GRU, reduce_range: bool, engine: str):
        super().__init__()
        self.mode = type(rnn).__name__
        self.reduce_range, self.engine = reduce_range, engine
        for name in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional"):
            setattr(self, name, getattr(rnn, name))
        self._nbytes = 0
        self._packed: list[torch.ScriptObject] = []   # one cell per layer and direction
        with quantized_engine(engine):
            for layer in range(rnn.num_layers):
                for suffix in ("", "_reverse")[: 2 if rnn.bidirectional else 1]:
                    packed, biases = [], []
                    for kind in ("ih", "hh"):
                        qweight = per_channel_qweight(getattr(rnn, f"weight_{kind}_l{layer}{suffix}"))
                        name = f"bias_{kind}_l{layer}{suffix}"
                        bias = getattr(rnn, name).detach().float()
                        packed.append(torch.ops.quantized.linear_prepack(qweight, bias))
                        biases.append(bias)
                        self._nbytes += qint8_nbytes(qweight, None)
                        # as PackedInt8 keeps its bias: the model keeps parameters, named as torch's
                        self.register_parameter(name, nn.Parameter(bias.clone(), requires_grad=False))
                    self._packed.append(torch.ops.quantized.make_quantized_cell_params_dynamic(
                        *packed, *biases, reduce_range))

    def flatten_parameters(self) -> None:
        """Nothing to do: the packed weights are one block already (models call this on their RNNs in forward)."""

    def forward(self, input: torch.Tensor | PackedSequence, hx: Any = None) -> tuple[Any, Any]:
        packed = isinstance(input, PackedSequence)
        data = input.data if packed else input
        outer = data.dtype
        unbatched = not packed and data.dim() == 2
        if unbatched:   # as nn.LSTM / nn.GRU take it: (time, features), state (layers, hidden)
            data = data.unsqueeze(0 if self.batch_first else 1)
            hx = None if hx is None else _map_state(hx, lambda h: h.unsqueeze(1))
        if not packed:
            batch = data.size(0 if self.batch_first else 1)
        else:   # the index's length where it has one: reading batch_sizes[0] would break a compiled graph
            batch = int(input.batch_sizes[0]) if input.sorted_indices is None else input.sorted_indices.numel()
        hx = self._initial_state(hx, batch, data.device, input.sorted_indices if packed else None)
        common = (self._packed, True, self.num_layers, float(self.dropout), False, self.bidirectional)
        data = data.float()
        if self.mode == "LSTM":
            if packed:
                out, *state = torch.quantized_lstm(data, input.batch_sizes, hx, *common, dtype=torch.qint8,
                                                   use_dynamic=True)
            else:
                out, *state = torch.quantized_lstm(data, hx, *common, self.batch_first, dtype=torch.qint8,
                                                   use_dynamic=True)
            state = tuple(state)
        elif packed:
            out, state = torch.quantized_gru(data, input.batch_sizes, hx, *common)
        else:
            out, state = torch.quantized_gru(data, hx, *common, self.batch_first)
        out, state = out.to(outer), _map_state(state, lambda h: h.to(outer))
        if packed:
            out = PackedSequence(out, input.batch_sizes, input.sorted_indices, input.unsorted_indices)
            if input.unsorted_indices is not None:
                state = _map_state(state, lambda h: h.index_select(1, input.unsorted_indices))
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
            state = _map_state(state, lambda h: h.squeeze(1))
        return out, state

    def _initial_state(self, hx: Any, batch: int, device: torch.device, sorted_indices: torch.Tensor | None) -> Any:
        if hx is None:
            zeros = torch.zeros(self.num_layers * (2 if self.bidirectional else 1), batch, self.hidden_size,
                                device=device)
            return (zeros, zeros) if self.mode == "LSTM" else zeros
        hx = _map_state(hx, lambda h: h.float())
        return hx if sorted_indices is None else _map_state(hx, lambda h: h.index_select(1, sorted_indices))

    def extra_repr(self) -> str:
        return (f"{self.mode}({self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
                f"bidirectional={self.bidirectional}), int8 dynamic")


def _map_state(state: Any, fn) -> Any:
    """An LSTM's (h, c) or a GRU's h, each tensor through `fn`."""
    return tuple(fn(h) for h in state) if isinstance(state, tuple) else fn(state)


@dataclass(frozen=True)
class Int8DynamicRNNConfig(Technique):
    """`nn.LSTM` / `nn.GRU` in int8 (per-channel weights, activations quantised per step), for inference. Not
    for one without biases or an LSTM with projections (`proj_size`): FBGEMM's cells have neither."""

    name: ClassVar[str] = "int8"
    reduce_range: bool | None = None     # 7-bit activations; None: where the CPU needs them (quantized)
    engine: str = "fbgemm"

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return (plain_type(module) in RNN_TYPES and module.bias and not getattr(module, "proj_size", 0)
                and engine_available(self.engine, device))

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        return DynamicInt8RNN(module, resolve_reduce_range(self.reduce_range), self.engine)

    def calibration_kept(self, calibration: CallInputs) -> CallInputs:
        return (), {}
