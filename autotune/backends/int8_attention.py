"""nn.MultiheadAttention with its projections as Linear modules (ProjectedAttention), and its int8 technique: the
packed input projection and the output projection as int8 Linears with dynamic activation quantisation (no
calibration needed), the attention between them in the floating dtype. The compiled engine quantises the same
module, with fp32 Linears, through pt2e."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from autotune.backends.base import CallInputs, Technique
from autotune.backends.int8_linear import Int8DynamicLinearConfig, linear_on
from autotune.backends.linear_engine import DEFAULT_ENGINE, timed_rows
from autotune.backends.quantized import engine_available, plain_type


def is_packed_attention(module: nn.Module) -> bool:
    """Whether `module` is an `nn.MultiheadAttention` that ProjectedAttention computes: q, k and v of one size (one
    packed input projection), without `bias_k` / `bias_v` or `add_zero_attn`."""
    return (plain_type(module) is nn.MultiheadAttention and module.in_proj_weight is not None
            and module.bias_k is None and not module.add_zero_attn)


class ProjectedAttention(nn.Module):
    """An `nn.MultiheadAttention` (inference only, see is_packed_attention) calling its projections as modules:
    `in_proj` (q, k and v packed) and `out_proj`, each the nn.Linear it computes as `project` makes it (int8, or
    as it is: torch's module reads its projections' weights, so neither a lowering nor a quantizer reaches them),
    the attention between them through scaled_dot_product_attention. Called and answering as the module it
    replaces, with the attributes parents read of theirs (torch's encoder layers read `batch_first`, `in_proj_bias`,
    `_qkv_same_embed_dim`, `num_heads`). Cross-attention projects its query and its memory each through the whole
    packed projection (twice the work of torch's split one)."""

    _qkv_same_embed_dim = True

    def __init__(self, attention: nn.MultiheadAttention, project: Callable[[nn.Linear], nn.Module]):
        super().__init__()
        self.embed_dim, self.num_heads = attention.embed_dim, attention.num_heads
        self.batch_first = attention.batch_first
        self.in_proj = project(linear_on(attention.in_proj_weight, attention.in_proj_bias))
        self.out_proj = project(linear_on(attention.out_proj.weight, attention.out_proj.bias))

    @property
    def in_proj_weight(self) -> torch.Tensor:
        return self.in_proj.weight

    @property
    def in_proj_bias(self) -> torch.Tensor | None:
        return self.in_proj.bias

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if is_causal and attn_mask is None:   # torch's own words; a causal mask applied here would change the model
            raise RuntimeError("Need attn_mask if specifying the is_causal hint")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(0 if self.batch_first else 1) for t in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        q, k, v = self._heads(query, key, value)
        mask = _additive_mask(attn_mask, key_padding_mask, q)
        causal = is_causal and key_padding_mask is None   # as torch's: attn_mask then only hints at causality
        if need_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            out = weights @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask, is_causal=causal)
            weights = None
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _heads(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
        """q, k and v projected, each (batch, heads, length, head size). Each distinct input goes through the packed
        projection once and keeps its thirds: self-attention projects once, as torch's does, also where its three
        inputs are equal copies (what the tuner records a module's call as)."""
        inputs, whole, thirds = (query, key, value), [], []
        for index, tensor in enumerate(inputs):
            earlier = next((j for j in range(index) if _same(inputs[j], tensor)), None)
            whole.append(self.in_proj(tensor) if earlier is None else whole[earlier])
            thirds.append(whole[index].chunk(3, dim=-1)[index])
        return [t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in thirds]

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are one input: the same tensor, or (run eagerly: traced, comparing values is no branch a
    graph can take) equal copies."""
    return a is b or (not torch.compiler.is_compiling() and a.shape == b.shape and torch.equal(a, b))


def _additive_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
                   q: torch.Tensor) -> torch.Tensor | None:
    """nn.MultiheadAttention's masks (boolean: True where not attended; or floats added to the scores) as one
    float mask added to the (batch, heads, query, key) scores; None where there is none."""
    def additive(mask: torch.Tensor) -> torch.Tensor:
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(mask, float("-inf"))
        return mask.to(q.dtype)

    merged = None
    if attn_mask is not None:   # (query, key), or (batch * heads, query, key)
        merged = additive(attn_mask)
        if merged.dim() == 3:
            merged = merged.view(q.shape[0], q.shape[1], *merged.shape[1:])
    if key_padding_mask is not None:   # (batch, key)
        padding = additive(key_padding_mask)[:, None, None, :]
        merged = padding if merged is None else merged + padding
    return merged


@dataclass(frozen=True)
class Int8DynamicMHAConfig(Technique):
    """`nn.MultiheadAttention` with int8 projections (per-channel weights, activations quantised per call), the
    attention between them in fp32: a ProjectedAttention of DynamicInt8Linears, for what is_packed_attention
    takes."""

    name: ClassVar[str] = "int8"
    reduce_range: bool | None = None     # 7-bit activations; None: where the CPU needs them (quantized)
    engine: str | None = None            # None: as Int8DynamicLinearConfig's, measured on the query

    def supports(self, module: nn.Module, device: torch.device) -> bool:
        return is_packed_attention(module) and engine_available(self.engine or DEFAULT_ENGINE, device)

    def lower(self, module: nn.Module, calibration: CallInputs | None) -> nn.Module:
        projections = Int8DynamicLinearConfig(self.reduce_range, self.engine)
        return ProjectedAttention(module, lambda linear: projections.lowered(linear, ((_query(calibration),), {})))

    def calibration_kept(self, calibration: CallInputs) -> CallInputs:
        """The rows of the query the projections' engine choice times, where it is made."""
        return ((timed_rows(_query(calibration)),), {}) if self.engine is None else ((), {})


def _query(calibration: CallInputs | None) -> object:
    args, kwargs = calibration or ((), {})
    return args[0] if args else kwargs.get("query")
