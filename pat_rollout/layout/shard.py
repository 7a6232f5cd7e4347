"""Sharding as data: which intervals of a full parameter a TP rank holds.

A parameter's sharded dim is a concatenation of partitions (q|k|v for fused QKV, gate|up for the
fused MLP). Each partition is `num_units` units of `unit_size` rows (a head is one unit of head_dim
rows). Units are split evenly over TP ranks; when a partition has fewer units than ranks (GQA KV
heads at large TP) each rank holds one unit, replicated, as SGLang does.

All ranges are half-open [lo, hi) offsets along the sharded dim of the *full* tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from pat_rollout.types import ModelSpec

Interval = tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    num_units: int
    unit_size: int

    @property
    def size(self) -> int:
        return self.num_units * self.unit_size

    def units_for_rank(self, tp_rank: int, tp_size: int) -> tuple[int, int]:
        """Half-open unit range [lo, hi) held by `tp_rank`."""
        if self.num_units >= tp_size:
            if self.num_units % tp_size:
                raise ValueError(f"tp_size={tp_size} must divide num_units={self.num_units}")
            per = self.num_units // tp_size
            return tp_rank * per, (tp_rank + 1) * per
        if tp_size % self.num_units:
            raise ValueError(f"num_units={self.num_units} must divide tp_size={tp_size} to replicate")
        unit = tp_rank * self.num_units // tp_size
        return unit, unit + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    """How one parameter is sharded. dim is None for replicated parameters (norms)."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    partitions: tuple[Partition, ...] = ()

    def __post_init__(self) -> None:
        if self.dim is not None and sum(p.size for p in self.partitions) != self.shape[self.dim]:
            raise ValueError(
                f"{self.name}: partitions {self.partitions} do not cover shape {self.shape} dim {self.dim}")

    def local_shape(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        n = sum(hi - lo for lo, hi in shard_intervals(self, tp_rank, tp_size))
        return self.shape[: self.dim] + (n,) + self.shape[self.dim + 1 :]

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def shard_intervals(spec: ShardSpec, tp_rank: int, tp_size: int) -> tuple[Interval, ...]:
    """Intervals of the full tensor's sharded dim held by `tp_rank`, in local storage order."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} out of range for tp_size={tp_size}")
    if spec.dim is None:
        return ((0, spec.shape[0]),) if spec.shape else ((0, 1),)
    out: list[Interval] = []
    offset = 0
    for part in spec.partitions:
        lo, hi = part.units_for_rank(tp_rank, tp_size)
        out.append((offset + lo * part.unit_size, offset + hi * part.unit_size))
        offset += part.size
    return tuple(out)


def kv_heads_for_rank(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Half-open range of KV heads whose cache lives on `tp_rank`."""
    return Partition(num_units=num_kv_heads, unit_size=1).units_for_rank(tp_rank, tp_size)


def padded_vocab_size(vocab_size: int, max_tp: int) -> int:
    """Vocab rows padded so every TP size dividing `max_tp` splits them evenly (shards then nest)."""
    return -(-vocab_size // max_tp) * max_tp


def model_shard_specs(spec: ModelSpec, max_tp: int) -> dict[str, ShardSpec]:
    """Shard specs of every parameter of the reference engine's (SGLang-style fused) model.

    Names follow SGLang: fused `qkv_proj` and `gate_up_proj`; embedding and LM head are
    vocab-parallel on the padded vocab.
    """
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_rows, kv_rows = spec.num_heads * d, spec.num_kv_heads * d
    vocab = padded_vocab_size(spec.vocab_size, max_tp)
    heads = Partition(num_units=spec.num_heads, unit_size=d)
    kv = Partition(num_units=spec.num_kv_heads, unit_size=d)
    mlp = Partition(num_units=inter, unit_size=1)
    rows = Partition(num_units=vocab, unit_size=1)
    out: dict[str, ShardSpec] = {}

    def add(name: str, shape: tuple[int, ...], dim: int | None, parts: tuple[Partition, ...] = ()) -> None:
        out[name] = ShardSpec(name=name, shape=shape, dim=dim, partitions=parts)

    add("model.embed_tokens.weight", (vocab, h), 0, (rows,))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (h,), None)
        add(p + "self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, h), 0, (heads, kv, kv))
        if spec.arch == "qwen3":
            add(p + "self_attn.q_norm.weight", (d,), None)
            add(p + "self_attn.k_norm.weight", (d,), None)
        add(p + "self_attn.o_proj.weight", (h, q_rows), 1, (heads,))
        add(p + "post_attention_layernorm.weight", (h,), None)
        add(p + "mlp.gate_up_proj.weight", (2 * inter, h), 0, (mlp, mlp))
        add(p + "mlp.down_proj.weight", (h, inter), 1, (mlp,))
    add("model.norm.weight", (h,), None)
    if not spec.tie_word_embeddings:
        add("lm_head.weight", (vocab, h), 0, (rows,))
    return out
