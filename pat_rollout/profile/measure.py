"""Measure a latency profile on the real worker pool (reference engine on CPU, or any backend the
workers run): decode-step time per (TP, batch, context), prefill throughput, point-to-point KV
bandwidth and the cost of each reconfiguration phase. Writes the schema of `profile/model.py`."""

from __future__ import annotations

import logging
import platform
import random
import statistics
import time
from dataclasses import dataclass

from pat_rollout.config import DTYPE_BYTES
from pat_rollout.engine.ref.config import RefEngineConfig
from pat_rollout.layout import Layout, model_shard_specs
from pat_rollout.profile.model import SCHEMA_VERSION
from pat_rollout.types import ModelSpec, Request, SamplingParams

logger = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileGrid:
    """Every layout of `tps` is timed at every (batch, context) point with `batch` requests on EACH replica, all
    replicas stepping at once through `RefPool.step` in calls of `steps_per_call` steps (the driver's
    steps_per_poll), `repeats` times `steps` steps; the median is the profile point, the range its spread."""

    tps: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    steps: int = 8  # decode steps per timed repeat
    steps_per_call: int = 4
    repeats: int = 3
    p2p_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        for name in ("tps", "batches", "contexts"):
            v = getattr(self, name)
            if not v or any(x < 1 for x in v):
                raise ValueError(f"{name}={v} must be a non-empty tuple of positive ints")
        for name in ("steps", "steps_per_call", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.steps % self.steps_per_call:
            raise ValueError(f"steps={self.steps} must be a multiple of steps_per_call={self.steps_per_call}")

    @property
    def context_offset(self) -> int:
        """Tokens a request has gained, on average, while its point is timed: the prefill step's token plus half
        of the timed steps. The profile records context + this, the mean context actually measured."""
        return 1 + self.repeats * self.steps // 2


def _requests(tag: str, batch: int, context: int, steps: int, vocab: int, rng: random.Random) -> list[Request]:
    return [Request(request_id=f"{tag}-{i}", prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(context)),
                    sampling=SamplingParams(max_new_tokens=steps + 4, ignore_eos=True)) for i in range(batch)]


def measure_profile(model_path: str, grid: ProfileGrid, *, num_devices: int, dtype: str = "float32",
                    block_size: int = 16, hardware: str | None = None) -> dict:
    """Run the grid on a fresh pool of `num_devices` Ray actors and return a profile dict (schema_version 1)."""
    from pat_rollout.workers.group import WorkerGroup
    from pat_rollout.workers.pool import RefPool
    from pat_rollout.workers.reconfigure import Reconfigurer

    max_tp = max(grid.tps)
    new_tokens = 1 + grid.repeats * grid.steps
    need_blocks = max(grid.batches) * -(-(max(grid.contexts) + new_tokens + 8) // block_size) + 8
    engine = RefEngineConfig(model_path=model_path, dtype=dtype, max_tp=max_tp, block_size=block_size,
                             num_kv_blocks=need_blocks, max_num_seqs=max(grid.batches),
                             max_prefill_tokens=max(grid.batches) * max(grid.contexts))
    spec = engine.model_spec()
    for tp in grid.tps:
        engine.check_tp(spec, tp)
    base = Layout.uniform(num_devices, min(grid.tps))
    group = WorkerGroup(world_size=num_devices, engine=engine, initial_layout=base, tp_sizes=grid.tps)
    reconf = Reconfigurer(group, spec, model_shard_specs(spec, max_tp), base, handoff="recompute",
                          dtype_bytes=DTYPE_BYTES[dtype])
    pool = RefPool(group, reconf, base, engine)
    rng = random.Random(0)
    decode, prefill, phases = [], [], []
    try:
        for tp in sorted(grid.tps):
            if pool.layout.tp_size != tp:
                src = pool.layout.tp_size
                phases.append((src, tp, pool.reconfigure(tp, {}).phase_s))
            for n in range(2):  # first touch of this layout's groups, KV pool and step buffers: not a profile point
                _time_point(pool, grid, max(grid.batches), min(grid.contexts), spec.vocab_size, rng, f"warm{tp}-{n}")
                _time_point(pool, grid, 1, min(grid.contexts), spec.vocab_size, rng, f"warm{tp}-1-{n}")
            prefill_points = []
            for batch in grid.batches:
                for context in grid.contexts:
                    prefill_s, steps_s = _time_point(pool, grid, batch, context, spec.vocab_size, rng,
                                                     f"p{tp}-{batch}-{context}")
                    step_s = statistics.median(steps_s)
                    decode.append({"tp": tp, "batch": batch, "context": context + grid.context_offset,
                                   "step_s": step_s, "step_s_range": [min(steps_s), max(steps_s)]})
                    prefill_points.append((batch * context, max(prefill_s - step_s, 1e-6)))
                    logger.info("tp=%d batch=%d/replica context=%d: decode %.2f ms/step (%.2f-%.2f over %d), "
                                "prefill %.1f ms", tp, batch, context, step_s * 1e3, min(steps_s) * 1e3,
                                max(steps_s) * 1e3, grid.repeats, prefill_s * 1e3)
            prefill.append(_fit_prefill(tp, prefill_points))
        bandwidth, latency = _measure_p2p(group, num_devices, grid.p2p_bytes)
        # Back to the base layout and up again `repeats` times: one reshard varies 2-3x run to run on a loaded
        # CPU, and a shrink (every device receives the weights it lacks) is what the planner weighs most.
        for n in range(grid.repeats):
            phases.append((pool.layout.tp_size, base.tp_size, pool.reconfigure(base.tp_size, {}).phase_s))
            if n + 1 < grid.repeats:
                phases.append((base.tp_size, max_tp, pool.reconfigure(max_tp, {}).phase_s))
    finally:
        group.shutdown()
    hardware = hardware or f"{platform.processor() or platform.machine()} CPU"
    phase_notes = [(a, b, {k: round(v, 4) for k, v in p.items()}) for a, b, p in phases]
    return {
        "schema_version": SCHEMA_VERSION,
        "meta": {"hardware": f"{hardware}, {num_devices} Ray actors (1 thread each)",
                 "model": model_path.rstrip("/").split("/")[-1], "backend": "reference", "source": "measured",
                 "notes": f"measured by python -m pat_rollout.profile on {time.strftime('%Y-%m-%d')}: every "
                          f"replica of a layout stepping at once through RefPool.step ({grid.steps_per_call} steps "
                          f"per call), batch = requests per replica, step_s = median of {grid.repeats} repeats of "
                          f"{grid.steps} steps, step_s_range = their min and max, context = prompt + "
                          f"{grid.context_offset} (the mean measured); gloo over loopback; reconfiguration phases "
                          f"{phase_notes}"},
        "model": {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "num_heads": spec.num_heads,
                  "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                  "param_bytes": spec.num_params() * DTYPE_BYTES[dtype], "dtype_bytes": DTYPE_BYTES[dtype]},
        "decode": decode,
        "prefill": prefill,
        "kv_transfer": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency},
        "reshard": _fit_reshard(phases, spec, dtype),
        "group_switch_s": statistics.median([p.get("switch", 0.0) for _, _, p in phases] or [0.0]),
    }


def _time_point(pool, grid: ProfileGrid, batch: int, context: int, vocab: int, rng: random.Random,
                tag: str) -> tuple[float, list[float]]:
    """`batch` requests on every replica, all stepping at once: (prefill + first step seconds, seconds per decode
    step of each repeat)."""
    replicas = list(range(pool.layout.num_replicas))
    new_tokens = 1 + grid.repeats * grid.steps
    pool.add_requests({r: _requests(f"{tag}-r{r}", batch, context, new_tokens, vocab, rng) for r in replicas})
    t0 = time.perf_counter()
    pool.step(replicas, 1)  # prefill (+ first token)
    prefill_s = time.perf_counter() - t0
    steps_s = []
    for _ in range(grid.repeats):
        t = time.perf_counter()
        for _ in range(grid.steps // grid.steps_per_call):
            pool.step(replicas, grid.steps_per_call)
        steps_s.append((time.perf_counter() - t) / grid.steps)
    pool.abort_all()
    return prefill_s, steps_s


def _fit_prefill(tp: int, points: list[tuple[int, float]]) -> dict:
    """tokens/s from the two extreme points; fixed_s is the intercept (>= 0)."""
    points.sort()
    (n0, t0), (n1, t1) = points[0], points[-1]
    rate = (n1 - n0) / max(t1 - t0, 1e-9) if n1 > n0 else n1 / t1
    return {"tp": tp, "tokens_per_s": rate, "fixed_s": max(0.0, t0 - n0 / rate)}


def _fit_reshard(phases: list[tuple[int, int, dict]], spec: ModelSpec, dtype: str) -> dict:
    """A grow only slices what each device holds: its time is the fixed cost. The median shrink of the first
    shrinking pair, less that, moves the bytes each device lacks: the bandwidth."""
    grow = [p.get("reshard", 0.0) + p.get("kv_handoff", 0.0) for a, b, p in phases if b > a]
    fixed = statistics.median(grow) if grow else 0.0
    bandwidth = 1e9
    shrinks = [(a, b) for a, b, _ in phases if b < a]
    if shrinks:
        a, b = shrinks[0]
        t = statistics.median(p.get("reshard", 0.0) for x, y, p in phases if (x, y) == (a, b))
        moved = spec.num_params() * DTYPE_BYTES[dtype] * (1 / b - 1 / a)
        bandwidth = moved / max(t - fixed, 1e-6)
    return {"bandwidth_bytes_per_s": bandwidth, "fixed_s": fixed}


def _measure_p2p(group, num_devices: int, nbytes: int) -> tuple[float, float]:
    if num_devices < 2:
        return 1e9, 1e-4
    small = group.call([0, 1], "measure_p2p", 64, 0, 1)[1]  # receiver-side time
    big = group.call([0, 1], "measure_p2p", nbytes, 0, 1)[1]
    return nbytes / max(big - small, 1e-9), small
