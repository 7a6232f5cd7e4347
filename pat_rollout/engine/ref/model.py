"""Llama-3 / Qwen3 decoder built only from layers.py; module paths equal shard-spec names
(`model.layers.{i}.self_attn.qkv_proj.weight`, ...), so named_parameters() is the shard dict."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.ref.attention import AttentionMetadata, paged_attention
from pat_rollout.engine.ref.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TPModule,
    VocabParallelEmbedding,
    apply_rope,
)
from pat_rollout.layout.shard import ShardSpec
from pat_rollout.types import ModelSpec


class Attention(TPModule):
    def __init__(self, spec: ModelSpec, specs: dict[str, ShardSpec], prefix: str, tp: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.qkv_proj = ColumnParallelLinear(specs[prefix + "qkv_proj.weight"], tp, dtype)
        self.o_proj = RowParallelLinear(specs[prefix + "o_proj.weight"], tp, dtype)
        if spec.arch == "qwen3":  # per-head RMSNorm on q and k, before RoPE
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype)
        self.bind(tp)

    def bind(self, tp: TPContext) -> None:
        super().bind(tp)
        self.num_heads = self.spec.num_heads // tp.size
        self.num_kv_heads = self.spec.num_local_kv_heads(tp.size)  # one replicated head when tp > kv heads

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        d = self.spec.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q, k, v = q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d), v.view(-1, self.num_kv_heads, d)
        if self.spec.arch == "qwen3":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, md.cos, md.sin), apply_rope(k, md.cos, md.sin)
        return self.o_proj(paged_attention(q, k, v, kv_layer, md))


class MLP(nn.Module):
    def __init__(self, specs: dict[str, ShardSpec], prefix: str, tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(specs[prefix + "gate_up_proj.weight"], tp, dtype)
        self.down_proj = RowParallelLinear(specs[prefix + "down_proj.weight"], tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # local shard is [gate rows | up rows]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, specs: dict[str, ShardSpec], prefix: str, tp: TPContext,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, specs, prefix + "self_attn.", tp, dtype)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = MLP(specs, prefix + "mlp.", tp, dtype)

    def forward(self, x: torch.Tensor, kv_layer: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_layer, md)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, specs: dict[str, ShardSpec], tp: TPContext, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(specs["model.embed_tokens.weight"], tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, specs, f"model.layers.{i}.", tp, dtype)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """forward(token ids [N], metadata, kv pool [L, 2, slots, Hkv, D]) -> full-vocab logits [B, vocab]
    at each sequence's last new token."""

    def __init__(self, spec: ModelSpec, specs: dict[str, ShardSpec], tp: TPContext, dtype: torch.dtype,
                 rope: dict) -> None:
        super().__init__()
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.model = DecoderModel(spec, specs, tp, dtype)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, rope, dtype)
        if not spec.tie_word_embeddings:
            self.lm_head = ColumnParallelLinear(specs["lm_head.weight"], tp, dtype)
        self.logits_head = ParallelLMHead(spec.vocab_size, tp)

    def bind(self, tp: TPContext) -> None:
        for m in self.modules():
            if isinstance(m, TPModule):
                m.bind(tp)

    def forward(self, input_ids: torch.Tensor, md: AttentionMetadata, kv_pool: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, kv_layer in zip(self.model.layers, kv_pool):
            x = layer(x, kv_layer, md)
        x = self.model.norm(x[md.last_index])  # only the rows that are sampled from
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return self.logits_head(x, weight)
