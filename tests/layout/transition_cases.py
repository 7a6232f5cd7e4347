"""Shared model specs and transitions for the transition / reshard property sweeps (pure)."""

from __future__ import annotations

from pat_rollout.layout import Layout, ShardSpec, model_shard_specs, plan_layout
from pat_rollout.types import ModelSpec

# (name, ModelSpec, max_tp, TP sizes it supports). Tiny dims keep exhaustive sweeps fast; vocab sizes
# are deliberately not multiples of max_tp so the padded-vocab path is exercised.
MODELS: dict[str, tuple[ModelSpec, int]] = {
    # GQA, KV heads replicated at tp 4 and 8.
    "llama_gqa2": (ModelSpec(arch="llama", num_layers=1, hidden_size=4, num_heads=8, num_kv_heads=2, head_dim=2,
                             intermediate_size=8, vocab_size=13), 8),
    # Qwen3 with q/k norms, tied embeddings, KV heads replicated at tp 8.
    "qwen3_gqa4": (ModelSpec(arch="qwen3", num_layers=2, hidden_size=6, num_heads=16, num_kv_heads=4, head_dim=2,
                             intermediate_size=16, vocab_size=10, tie_word_embeddings=True), 8),
    # 6-device family: KV split at every tp in {1, 2, 3, 6}; 2 <-> 3 needs the greedy fallback.
    "qwen3_kv6": (ModelSpec(arch="qwen3", num_layers=1, hidden_size=4, num_heads=12, num_kv_heads=6, head_dim=2,
                            intermediate_size=12, vocab_size=7), 6),
    # MQA: one KV head replicated on every rank.
    "llama_mqa": (ModelSpec(arch="llama", num_layers=1, hidden_size=4, num_heads=6, num_kv_heads=1, head_dim=2,
                            intermediate_size=6, vocab_size=5), 6),
}


def valid_tps(model: ModelSpec, max_tp: int, num_devices: int) -> list[int]:
    out = []
    for tp in range(1, num_devices + 1):
        if num_devices % tp or max_tp % tp:
            continue
        try:
            model.check_tp(tp)
        except ValueError:
            continue
        out.append(tp)
    return out


def specs_for(name: str) -> dict[str, ShardSpec]:
    model, max_tp = MODELS[name]
    return model_shard_specs(model, max_tp)


def transitions() -> list[tuple[str, Layout, Layout]]:
    """(model name, src, dst) for 1..8 devices, every ordered pair of valid TP sizes, starting both from
    the uniform layout and from the layout reached from TP=1 by plan_layout (scrambled rank orders)."""
    out = []
    for name, (model, max_tp) in MODELS.items():
        for n in range(1, 9):
            tps = valid_tps(model, max_tp, n)
            for tp_src in tps:
                starts = {Layout.uniform(n, tp_src), plan_layout(Layout.uniform(n, 1), tp_src)}
                for src in sorted(starts, key=str):
                    for tp_dst in tps:
                        if tp_dst != tp_src:
                            out.append((name, src, plan_layout(src, tp_dst)))
    return out


CHAINS: list[tuple[str, int, list[int]]] = [
    # (model, num_devices, TP sizes visited in order), including there and back.
    ("llama_gqa2", 8, [2, 4, 8, 4, 2]),
    ("qwen3_gqa4", 8, [1, 2, 4, 8, 4, 2, 1]),
    ("qwen3_gqa4", 8, [1, 8, 2, 4, 1]),
    ("qwen3_kv6", 6, [1, 2, 3, 6, 3, 2, 1]),
    ("llama_mqa", 6, [2, 3, 1, 6, 2]),
]


def CASES_SMALL_IDS(cases: list[tuple[str, Layout, Layout]]) -> list[str]:  # noqa: N802
    return [f"{n}-{s}-{d}" for n, s, d in cases]
