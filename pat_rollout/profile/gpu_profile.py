"""What a shard-shape run measured -> a schema-v1 profile (pure stdlib; `model.py` loads the result).

Per TP size: the grid points the run finished (a budget stop keeps whole context columns), points whose KV did not
fit on the device filled by context-linear extrapolation and marked, rows that cannot be filled dropped and
listed. step_s = measured compute of one rank (CUDA graph when captured, else eager) + the published collective
latency (`gpu_plan.allreduce_s`). Prefill is derived from the measured decode grid; transfer, reshard and group
switch costs are the assumed ones of `published.py`. `meta` says which number came from where.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pat_rollout.profile.gpu_plan import (
    MODELS,
    GpuGrid,
    RankShape,
    allreduce_s,
    num_collectives,
    profile_shape,
)
from pat_rollout.profile.model import SCHEMA_VERSION
from pat_rollout.profile.published import AR_LATENCY_S, ASSUMED, EFF, FIG, MEM_FRACTION, SRC

FILLED = ("extrapolated linearly in context from this batch's measured points: its KV (or the step) did not fit on "
          "the device")


@dataclass(frozen=True, kw_only=True, slots=True)
class PointResult:
    """One measured (batch, context): per-step seconds (median, min, max) eager, and with a CUDA graph if any."""

    batch: int
    context: int
    eager: tuple[float, float, float]
    graph: tuple[float, float, float] | None
    wall_s: float


@dataclass(kw_only=True, slots=True)
class TpResult:
    """Everything one TP size's run produced. `stopped_at`: the first point the time budget did not start."""

    tp: int
    shape: RankShape
    kv_budget_bytes: float
    points: list[PointResult] = field(default_factory=list)
    skipped: list[tuple[int, int]] = field(default_factory=list)  # KV did not fit
    out_of_memory: list[tuple[int, int]] = field(default_factory=list)  # KV fitted, the step's activations did not
    stopped_at: tuple[int, int] | None = None
    wall_s: float = 0.0


def _row_fill(known: dict[int, float], contexts: list[int], slope: float) -> dict[int, float]:
    last = max(known)
    return {c: known.get(c, known[last] + slope * (c - last)) for c in contexts}


def fill_grid(res: TpResult, grid: GpuGrid, column: str) -> tuple[dict[tuple[int, int], float], list[int], list[int]]:
    """(value per kept (batch, context), kept batches, kept contexts) of `column` ("eager" or "graph" medians).

    Kept contexts: the columns the run finished. A row with >= 2 measured points is extended with the slope of
    its two largest measured contexts (the KV read grows linearly in context); a row with one takes the slope of
    the nearest smaller row that has one, scaled by the batch ratio; rows left without a slope are dropped."""
    done = [c for c in grid.contexts if res.stopped_at is None or c < res.stopped_at[1]]
    meas: dict[int, dict[int, float]] = {}
    for p in res.points:
        v = p.eager if column == "eager" else p.graph
        if p.context in done and v is not None:
            meas.setdefault(p.batch, {})[p.context] = v[0]
    values: dict[tuple[int, int], float] = {}
    slopes: dict[int, float] = {}
    kept = []
    for b in grid.batches:
        known = meas.get(b, {})
        if len(known) >= 2:
            c1, c2 = sorted(known)[-2:]
            slopes[b] = max(0.0, (known[c2] - known[c1]) / (c2 - c1))
        elif len(known) == 1 and slopes:
            below = max(x for x in slopes if x < b)
            slopes[b] = slopes[below] * b / below
        if not known or (b not in slopes and len(known) < len(done)):
            continue
        kept.append(b)
        for c, v in _row_fill(known, done, slopes.get(b, 0.0)).items():
            values[(b, c)] = v
    return values, kept, done if kept else []


def _rank_meta(spec_name: str, shape: RankShape) -> dict:
    spec = MODELS[spec_name][1]
    return {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "kv_replication": shape.kv_replication,
            "intermediate_size": shape.intermediate_size, "vocab_rows": shape.vocab_rows,
            "weight_bytes": shape.weight_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token(spec.num_layers,
                                                                                               spec.head_dim)}


def build_profile(model: str, grid: GpuGrid, results: list[TpResult], *, env: dict, graph: bool,
                  ar_variant: str = "central", wall_s: float = 0.0, max_seconds: float | None = None) -> dict:
    """The schema-v1 profile of a run. `env`: {"hardware", "device", "torch", "cuda", "hbm_bytes" (None on CPU),
    "dtype", "date", "sdpa"}. TP sizes with nothing to keep are left out and listed in meta.omitted_tps."""
    spec = MODELS[model][1]
    column = "graph" if graph else "eager"
    decode, prefill, filled, omitted, dropped, unused = [], [], [], {}, {}, []
    for res in results:
        step, batches, contexts = fill_grid(res, grid, column)
        other = fill_grid(res, grid, "eager")[0] if graph else step
        for p in res.points:  # measured, but outside the rectangle the profile keeps (a column cut by the budget)
            if (p.batch, p.context) not in step:
                unused.append([res.tp, p.batch, p.context, (p.graph or p.eager)[0]])
        if not batches:
            omitted[str(res.tp)] = "no finished context column" if res.stopped_at else "no point fitted in memory"
            continue
        ar = allreduce_s(spec, res.tp, ar_variant)
        measured = {(p.batch, p.context): p for p in res.points}
        dropped[str(res.tp)] = [b for b in grid.batches if b not in batches]
        for b in batches:
            for c in contexts:
                point = {"tp": res.tp, "batch": b, "context": c, "step_s": step[(b, c)] + ar,
                         "compute_s": step[(b, c)], "eager_s": other[(b, c)], "allreduce_s": ar}
                m = measured.get((b, c))
                if m is None:
                    point["filled"] = FILLED
                    filled.append([res.tp, b, c])
                else:
                    lo_hi = m.graph if graph else m.eager
                    point["step_s_range"] = [lo_hi[1] + ar, lo_hi[2] + ar]
                decode.append(point)
        prefill.append(_prefill(res.tp, batches, contexts[0], step, ar))
    hardware = env["hardware"]
    meta = {
        "hardware": hardware, "model": f"{MODELS[model][0]} shapes, random {env['dtype']} weights",
        "backend": "torch shard-shape step (no SGLang)", "source": "measured",
        "notes": (f"measured by python -m pat_rollout.profile.gpu on {env['date']}: ONE rank of each TP=k replica "
                  f"(its shard shapes) timed alone on one {env['device']} device; step_s = "
                  f"{'CUDA-graph' if graph else 'eager'} compute median + the PUBLISHED collective latency "
                  f"({num_collectives(spec)} collectives x {AR_LATENCY_S[ar_variant]:.3g} s, {ar_variant}) for TP>1; "
                  f"eager_s is the eager column; points marked 'filled' are extrapolated, not measured"),
        "device": env["device"], "torch": env["torch"], "cuda": env["cuda"], "graph": graph, "step_s_column": column,
        "measured": (f"per-step time of one rank's decode at its TP=k shard shapes ({column} median of "
                     f"{grid.repeats} repeats of {grid.steps_per_repeat} steps after {grid.warmup} warm-up; CUDA "
                     f"events on GPU, perf_counter on CPU); also the eager column"),
        "attention": (f"torch scaled_dot_product_attention ({env['sdpa']} backend) over the rank's KV heads, "
                      f"the GQA group's query heads as query rows"),
        "kv_layout": "dense per layer [batch, kv_heads, context, head_dim], one context for all requests "
                     "(not paged: no page-table gather)",
        "weights": f"random {env['dtype']} made on the device (nothing downloaded); vocab padded to a multiple of "
                   f"max TP {max(grid.tps)}",
        "rank_shapes": {str(r.tp): _rank_meta(model, r.shape) for r in results},
        "grid": {"tps": list(grid.tps), "batches": list(grid.batches), "contexts": list(grid.contexts),
                 "warmup": grid.warmup, "repeats": grid.repeats, "steps_per_repeat": grid.steps_per_repeat},
        "kv_budget_bytes": {str(r.tp): r.kv_budget_bytes for r in results},
        "skipped": {str(r.tp): [list(x) for x in r.skipped] for r in results},
        "out_of_memory": {str(r.tp): [list(x) for x in r.out_of_memory] for r in results if r.out_of_memory},
        "filled": filled, "dropped_batches": dropped, "omitted_tps": omitted,
        "unused_points": {"columns": ["tp", "batch", "context", f"{column} compute_s"], "rows": unused},
        "stopped": {str(r.tp): list(r.stopped_at) for r in results if r.stopped_at},
        "wall_s": {"total": round(wall_s, 2), "max_seconds": max_seconds,
                   **{str(r.tp): round(r.wall_s, 2) for r in results}},
        "sources": {
            "decode_compute": f"measured here ({column}); eager_s measured here",
            "allreduce_s": (f"{num_collectives(spec)} collectives per step (2 per layer + embedding all-reduce + "
                            f"logits all-gather) x {AR_LATENCY_S[ar_variant]:.3g} s ({ar_variant} of 7-15 us): "
                            f"{SRC['ar']} ({FIG}). Published for messages <= 0.5 MB; a step's all-reduce is "
                            f"batch x {spec.hidden_size * 2} B (> 0.5 MB from batch "
                            f"{-(-(1 << 19) // (spec.hidden_size * 2))}) and the logits all-gather larger, so "
                            f"there the term is a lower bound (no published bandwidth figure for these sizes)"),
            "prefill": "derived from the measured decode grid at the smallest context: tokens/s = extra batch / "
                       "extra step time between the smallest and largest batch, fixed_s = the rest of the "
                       "smallest batch's step (decode GEMM cost per token; prefill's longer attention not measured)",
            "kv_transfer": "assumed (published.ASSUMED), not measured", "reshard": "assumed (published.ASSUMED)",
            "group_switch_s": "assumed (published.ASSUMED)",
        },
        "assumed": dict(ASSUMED),
    }
    out = {
        "schema_version": SCHEMA_VERSION, "meta": meta,
        "model": asdict(profile_shape(spec)),
        "decode": decode, "prefill": prefill,
        "kv_transfer": {"bandwidth_bytes_per_s": ASSUMED["kv_bytes_per_s"], "latency_s": ASSUMED["kv_latency_s"]},
        "reshard": {"bandwidth_bytes_per_s": ASSUMED["reshard_bytes_per_s"], "fixed_s": ASSUMED["reshard_fixed_s"]},
        "group_switch_s": ASSUMED["group_switch_s"],
    }
    meta["tp_efficiency"] = tp_efficiency(decode)
    meta["sources"]["tp_efficiency"] = (f"per-GPU decode throughput of TP k relative to TP1 at the same batch per "
                                        f"replica, t1 / (k tk), from step_s above; bracket: {FIG} 'TP cost under "
                                        f"load' (low / central / high = {EFF['low']} / {EFF['central']} / "
                                        f"{EFF['high']})")
    if env.get("hbm_bytes"):
        out["memory"] = {"hbm_bytes": float(env["hbm_bytes"]), "mem_fraction": MEM_FRACTION,
                         "activation_reserve_bytes": ASSUMED["activation_reserve_bytes"]}
        meta["sources"]["memory"] = (f"hbm_bytes: the device's total memory as torch reports it; mem_fraction "
                                     f"{MEM_FRACTION}: {SRC['mem']}; activation reserve assumed")
    return out


def _prefill(tp: int, batches: list[int], c0: int, step: dict[tuple[int, int], float], ar: float) -> dict:
    b0, b1 = batches[0], batches[-1]
    t0, t1 = step[(b0, c0)] + ar, step[(b1, c0)] + ar
    rate = (b1 - b0) / (t1 - t0) if b1 > b0 and t1 > t0 else b1 / t1
    return {"tp": tp, "tokens_per_s": rate, "fixed_s": max(0.0, t0 - b0 / rate)}


def bracket_of(tp: int, eff: float) -> str:
    """Where a per-GPU efficiency falls in the published bracket of TP `tp` (profile/published.py's EFF)."""
    low, central, high = EFF["low"][tp], EFF["central"][tp], EFF["high"][tp]
    if eff < low:
        return "below low"
    if eff > high:
        return "above high"
    return "low-central" if eff < central else "central-high"


def tp_efficiency(decode: list[dict], batches=(64, 256, 512), contexts=(128, 2048)) -> list[dict]:
    """t1 / (k tk) at each (batch, context) of `batches` x `contexts` that TP1 and TP k both have (measured or
    filled; `filled` says which), with the published bracket it falls in."""
    pts = {(p["tp"], p["batch"], p["context"]): p for p in decode}
    out = []
    for b in batches:
        for c in contexts:
            t1 = pts.get((1, b, c))
            if t1 is None:
                continue
            for k in sorted({tp for tp, _, _ in pts if tp > 1 and tp in EFF["low"]}):
                tk = pts.get((k, b, c))
                if tk is not None:
                    eff = t1["step_s"] / (k * tk["step_s"])
                    out.append({"tp": k, "batch": b, "context": c, "eff": round(eff, 4), "bracket": bracket_of(k, eff),
                                "filled": "filled" in t1 or "filled" in tk})
    return out
