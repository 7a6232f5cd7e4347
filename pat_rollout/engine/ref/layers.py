"""Tensor-parallel layers of the reference model.

Each parameter is allocated at `spec.local_shape(tp.rank, tp.size)`: the layer never divides
shapes by a world size itself. Layers that communicate or index by rank hold a TPContext that
`bind` replaces when PAT switches TP (the parameters are swapped by the engine at the same time).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.layout.shard import ShardSpec, shard_intervals


def frozen_param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class TPModule(nn.Module):
    """A module whose computation depends on the TP group it is bound to."""

    tp: TPContext

    def bind(self, tp: TPContext) -> None:
        self.tp = tp


class ShardedWeight(TPModule):
    """Holds one sharded weight, named `weight` so module paths equal shard-spec names."""

    def __init__(self, spec: ShardSpec, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.weight = frozen_param(torch.zeros(spec.local_shape(tp.rank, tp.size), dtype=dtype))
        self.bind(tp)


class ColumnParallelLinear(ShardedWeight):
    """Output rows split over ranks (fused qkv_proj, gate_up_proj): no communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(ShardedWeight):
    """Input columns split over ranks (o_proj, down_proj): partial sums are all-reduced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(ShardedWeight):
    """Rows of the padded vocab split over ranks; ids outside the local range embed to zero and
    the all-reduce fills them from the owning rank (exact: one non-zero term per element)."""

    def bind(self, tp: TPContext) -> None:
        super().bind(tp)
        ((self.lo, self.hi),) = shard_intervals(self.spec, tp.rank, tp.size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.lo) & (ids < self.hi)
        out = F.embedding((ids - self.lo) * inside, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(TPModule):
    """Vocab-parallel output projection: each rank scores its vocab rows, logits are gathered in
    rank order (= padded vocab order) and the padding columns dropped."""

    def __init__(self, vocab_size: int, tp: TPContext) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.bind(tp)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(hidden, weight), dim=-1)[:, : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen_param(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reduce in at least fp32 (bf16 would lose the mean); fp64 stays fp64.
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, rope: dict) -> torch.Tensor:
    """HF-identical inverse frequencies (fp32), with Llama-3 frequency scaling when configured."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.get("rope_type", "default") != "llama3":
        return inv_freq
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, precomputed once (fp32 like HF, then cast)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope: dict, dtype: torch.dtype) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, rope))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, D] already gathered at the tokens' positions (rotate-half style)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)
