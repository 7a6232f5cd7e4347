"""Plan of a one-GPU shard-shape profile (pure stdlib): the model shapes, what ONE rank of TP=k holds, which
(batch, context) points fit in memory, how long the run should take, and how a time budget is shared.

The torch side (`gpu_step.py`) builds exactly the shapes `rank_shape` returns; `gpu_profile.py` turns what it
measured into the profile schema of `model.py`. Nothing here imports torch, so the plan and its budget are
checked in CI without one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pat_rollout.layout.shard import model_shard_specs
from pat_rollout.profile.model import ProfileModelShape
from pat_rollout.profile.published import AR_LATENCY_S, EFF, GPUS, solve_anchors
from pat_rollout.profile.published import GpuStepModel as _PublishedStepModel
from pat_rollout.types import ModelSpec

# Public config.json values (HF hub: meta-llama/Llama-3.1-8B, Qwen/Qwen3-14B); the tiny ones are for CPU tests:
# 2 KV heads so TP4 and TP8 replicate them, as SGLang does.
MODELS: dict[str, tuple[str, ModelSpec]] = {
    "llama31_8b": ("meta-llama/Llama-3.1-8B", ModelSpec(
        arch="llama", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072)),
    "qwen3_14b": ("Qwen/Qwen3-14B", ModelSpec(
        arch="qwen3", num_layers=40, hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128,
        intermediate_size=17408, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960)),
    "tiny_llama": ("tiny Llama-shaped test model", ModelSpec(
        arch="llama", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=8,
        intermediate_size=96, vocab_size=250, max_position_embeddings=4096)),
    "tiny_qwen3": ("tiny Qwen3-shaped test model (q/k norm)", ModelSpec(
        arch="qwen3", num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=8,
        intermediate_size=96, vocab_size=250, max_position_embeddings=4096)),
}
DEFAULT_TPS = (1, 2, 4, 8)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_CONTEXTS = (128, 512, 2048, 8192, 16384)
# Not published; only the time estimate uses them (the run itself is held to --max-seconds by its clock).
EST_KERNELS_PER_LAYER = 50  # torch ops of one layer of gpu_step.ShardStep in eager mode (Qwen3: ~55, Llama: ~40)
EST_LAUNCH_S = 12e-6  # host time per eager op (Python + dispatch + launch)
EST_CAPTURE_S = 0.05  # one CUDA graph capture, beyond its warm-up steps
EST_TP_SETUP_S = 2.0  # random weights + KV buffer for one TP size, and freeing them
EST_START_S = 30.0  # interpreter, torch import, CUDA context


@dataclass(frozen=True, kw_only=True, slots=True)
class RankShape:
    """What one rank of a TP=`tp_size` replica holds. KV heads: split when tp <= KV heads, else one head per
    rank, each replicated on `kv_replication` ranks (SGLang's rule). `vocab_rows` is the padded vocab / tp."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    kv_replication: int
    intermediate_size: int
    vocab_rows: int
    weight_shapes: tuple[tuple[str, tuple[int, ...]], ...]  # every parameter's local shape, in model order
    dtype_bytes: int

    @property
    def weight_bytes(self) -> int:
        return self.dtype_bytes * sum(math.prod(s) for _, s in self.weight_shapes)

    def kv_bytes_per_token(self, num_layers: int, head_dim: int) -> int:
        """K and V of one token on this rank, all layers."""
        return 2 * num_layers * self.num_kv_heads * head_dim * self.dtype_bytes


def rank_shape(spec: ModelSpec, tp: int, *, max_tp: int, dtype_bytes: int = 2) -> RankShape:
    """Rank 0's shard shapes at TP=`tp`, read from the same shard specs the engines load weights by."""
    spec.check_tp(tp)
    specs = model_shard_specs(spec, max_tp)
    shapes = tuple((name, s.local_shape(0, tp)) for name, s in specs.items())
    local = dict(shapes)
    d = spec.head_dim
    num_heads = local["model.layers.0.self_attn.o_proj.weight"][1] // d
    num_kv = (local["model.layers.0.self_attn.qkv_proj.weight"][0] - num_heads * d) // (2 * d)
    return RankShape(tp_size=tp, num_heads=num_heads, num_kv_heads=num_kv,
                     kv_replication=max(1, tp // spec.num_kv_heads), vocab_rows=local["model.embed_tokens.weight"][0],
                     intermediate_size=local["model.layers.0.mlp.down_proj.weight"][1], weight_shapes=shapes,
                     dtype_bytes=dtype_bytes)


def profile_shape(spec: ModelSpec, dtype_bytes: int = 2) -> ProfileModelShape:
    """The profile's `model` section: the full (unsharded) model."""
    return ProfileModelShape(num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_heads=spec.num_heads,
                             num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                             param_bytes=spec.num_params() * dtype_bytes, dtype_bytes=dtype_bytes)


def num_collectives(spec: ModelSpec) -> int:
    """Collectives of one TP>1 decode step as SGLang runs it: 2 all-reduces per layer (after o_proj and down_proj),
    1 after the vocab-parallel embedding, 1 all-gather of the logits."""
    return 2 * spec.num_layers + 2


def allreduce_s(spec: ModelSpec, tp: int, variant: str = "central") -> float:
    """The collective term added to a measured step: published small-message latency x collectives per step."""
    return 0.0 if tp == 1 else num_collectives(spec) * AR_LATENCY_S[variant]


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuGrid:
    """Points timed for every TP size: contexts ascending (outer), batches ascending (inner), so a run stopped by
    its budget keeps whole context columns. Each point: `warmup` steps, then `repeats` timings of
    `steps_per_repeat` steps (CUDA events around them); the median repeat is the point, min-max its range."""

    tps: tuple[int, ...] = DEFAULT_TPS
    batches: tuple[int, ...] = DEFAULT_BATCHES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    warmup: int = 2
    repeats: int = 5
    steps_per_repeat: int = 3

    def __post_init__(self) -> None:
        for name in ("tps", "batches", "contexts"):
            v = getattr(self, name)
            if not v or any(x < 1 for x in v) or list(v) != sorted(set(v)):
                raise ValueError(f"{name}={v} must be a non-empty, strictly ascending tuple of positive ints")
        for name in ("warmup", "repeats", "steps_per_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    def points(self) -> list[tuple[int, int]]:
        """(batch, context) in measuring order."""
        return [(b, c) for c in self.contexts for b in self.batches]


def kv_point_bytes(spec: ModelSpec, shape: RankShape, batch: int, context: int) -> int:
    """Dense KV of one point on one rank: `batch` requests x `context` slots (the new token's included)."""
    return batch * context * shape.kv_bytes_per_token(spec.num_layers, spec.head_dim)


def fits(spec: ModelSpec, shape: RankShape, batch: int, context: int, kv_budget_bytes: float) -> bool:
    return kv_point_bytes(spec, shape, batch, context) <= kv_budget_bytes


class StepEstimate:
    """A-priori decode-step seconds of one rank on an H200-class GPU: the published-figure model of
    profile/published.py (central variant, no all-reduce: one rank computes alone), for any shape. Only sizes the
    run; nothing it says is written as a measurement."""

    def __init__(self, spec: ModelSpec, gpu: str = "h200") -> None:
        e, fixed, comp1 = solve_anchors("central")
        shape = profile_shape(spec)
        self.spec = spec
        self._m = _PublishedStepModel(shape=shape, hbm_bytes_per_s=GPUS[gpu][2], hbm_eff=e, fixed_s=fixed,
                                      comp1_s=comp1 * shape.param_bytes / (2 * 8_030_261_248), ar_latency_s=0.0,
                                      eff=dict(EFF["central"]))

    def graph_s(self, tp: int, batch: int, context: int) -> float:
        return self._m.decode_step_s(tp, batch, context)

    def eager_s(self, tp: int, batch: int, context: int) -> float:
        # Eager is host-bound until the GPU work outlasts the launches.
        return max(self.graph_s(tp, batch, context), self.spec.num_layers * EST_KERNELS_PER_LAYER * EST_LAUNCH_S)

    def point_s(self, grid: GpuGrid, tp: int, batch: int, context: int, graph: bool) -> float:
        """Wall seconds of one point: eager warm-up and repeats, then (with graphs) capture, warm-up, repeats."""
        steps = grid.warmup + grid.repeats * grid.steps_per_repeat
        t = steps * self.eager_s(tp, batch, context)
        if graph:
            t += EST_CAPTURE_S + 2 * self.eager_s(tp, batch, context) + steps * self.graph_s(tp, batch, context)
        return t


def estimate_run_s(models: list[str], grid: GpuGrid, *, kv_budget: dict[tuple[str, int], float],
                   graph: bool = True, gpu: str = "h200") -> float:
    """Estimated wall seconds of a whole run (start-up included); points whose KV does not fit cost nothing."""
    total = EST_START_S
    for name in models:
        spec = MODELS[name][1]
        est = StepEstimate(spec, gpu)
        for tp in grid.tps:
            shape = rank_shape(spec, tp, max_tp=max(grid.tps))
            total += EST_TP_SETUP_S
            total += sum(est.point_s(grid, tp, b, c, graph) for b, c in grid.points()
                         if fits(spec, shape, b, c, kv_budget[(name, tp)]))
    return total


def kv_budget_bytes(free_bytes: float, reserve_bytes: float) -> float:
    """KV room on the device once the rank's weights are allocated: what is free less a reserve for activations,
    logits and graph pools."""
    return max(0.0, free_bytes - reserve_bytes)


class Budget:
    """A wall-clock deadline. `sub` hands a part its share of the time left, weighted by its estimated cost among
    what is still to run, so a slow TP1 cannot starve TP8 and time a part leaves unused flows to the next. `clock`
    is injectable for tests."""

    def __init__(self, deadline: float, clock) -> None:
        self.clock = clock
        self.deadline = deadline

    @classmethod
    def start(cls, max_seconds: float, clock) -> Budget:
        return cls(clock() + max_seconds, clock)

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def sub(self, own_cost: float, remaining_cost: float) -> Budget:
        """The share of a part estimated at `own_cost` out of `remaining_cost` still to run (its own included)."""
        frac = min(1.0, own_cost / remaining_cost) if remaining_cost > 0 else 1.0
        return Budget(self.clock() + self.left() * frac, self.clock)

    def allows(self, seconds: float) -> bool:
        """Whether work predicted to take `seconds` ends before the deadline."""
        return self.clock() + seconds <= self.deadline
