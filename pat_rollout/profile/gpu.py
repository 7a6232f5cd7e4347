"""Measure what no source publishes: one rank's decode step at the TP=k shard shapes of a model, on one device.

A TP=k replica's rank runs the same batch over heads/k, KV heads/k (one replicated head when k > KV heads),
intermediate/k and vocab/k; one GPU can time that. Only the collectives between ranks need a figure: their
published latency is added and labelled (`gpu_profile.py`). Random bf16 weights are made on the device (nothing
downloaded), the step is captured in a CUDA graph as serving engines run it, and eager is timed as a second
column. Pure torch: no SGLang, no Ray, no network. Writes `<out-dir>/<tag>_<model>_measured.json` (schema v1,
`LatencyModel.from_json` loads it; also by name from profile/data/), rewritten after every TP size, so a run that
is killed keeps what it finished.

On an H200 (the device machine has torch, no SGLang, no network; run from the repo root), both models, at most
8 minutes wall (the run itself is held to 420 s; `timeout` is the backstop):

    PYTHONUNBUFFERED=1 timeout 480 python3 -m pat_rollout.profile.gpu --models llama31_8b,qwen3_14b \\
        --max-seconds 420 --out-dir pat_rollout/profile/data

    -> pat_rollout/profile/data/h200_llama31_8b_measured.json, pat_rollout/profile/data/h200_qwen3_14b_measured.json

Through the `device` tool only files under $OUT come back: there pass `--out-dir "$OUT"` (and `2>&1 | tee
"$OUT/gpu_profile.log"`), then copy the two JSON files into pat_rollout/profile/data/ and commit them. They load by
name: `LatencyModel.from_json("h200_llama31_8b_measured")`. Expected: ~280 s by `--dry-run`'s estimate.

`--dry-run` prints the plan (points, KV skips, estimated seconds) without touching a device. On CPU (tests, CI)
the same code runs eager only: `--device cpu --models tiny_llama --batches 1,2 --contexts 16,32 --tps 1,2,4,8`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from pathlib import Path

from pat_rollout.profile.gpu_plan import (
    DEFAULT_BATCHES,
    DEFAULT_CONTEXTS,
    DEFAULT_TPS,
    MODELS,
    Budget,
    GpuGrid,
    StepEstimate,
    estimate_run_s,
    fits,
    kv_budget_bytes,
    kv_point_bytes,
    rank_shape,
)
from pat_rollout.profile.gpu_profile import PointResult, TpResult, build_profile
from pat_rollout.profile.published import GPUS

logger = logging.getLogger(__name__)
GIB = 1 << 30


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def device_tag(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' for the CPU."""
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "tesla")]
    return words[0] if words else "gpu"


def measure_tp(model: str, tp: int, grid: GpuGrid, *, device, dtype, graph: bool, sdpa: str, reserve_bytes: float,
               kv_limit_bytes: float | None, budget: Budget, calib: list[float]) -> TpResult:
    """Time every grid point of one TP size that fits in memory and in `budget`. `calib` ([measured wall,
    estimated wall] so far, shared across TP sizes of a model) turns estimates into predictions."""
    import torch

    from pat_rollout.profile.gpu_step import ShardStep

    spec = MODELS[model][1]
    shape = rank_shape(spec, tp, max_tp=max(grid.tps))
    est = StepEstimate(spec)
    t_start = time.perf_counter()
    step = ShardStep(spec, shape, device=device, dtype=dtype, max_context=max(grid.contexts), sdpa=sdpa)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        room = kv_budget_bytes(free, reserve_bytes)
        room = room if kv_limit_bytes is None else min(room, kv_limit_bytes)
    else:
        room = float(kv_limit_bytes if kv_limit_bytes is not None else 256 << 20)
    res = TpResult(tp=tp, shape=shape, kv_budget_bytes=room)
    fitting = [(b, c) for b, c in grid.points() if fits(spec, shape, b, c, room)]
    need = max((kv_point_bytes(spec, shape, b, c) for b, c in fitting), default=0)
    buffer = torch.empty(need // shape.dtype_bytes, device=device, dtype=dtype)
    buffer.normal_(0.0, 1.0)  # random like a real cache (GPUs run measurably faster on zeros)
    logger.info("%s tp=%d: rank weights %.2f GB, KV room %.2f GB, buffer %.2f GB, %d/%d points fit, setup %.1f s",
                model, tp, shape.weight_bytes / 1e9, room / 1e9, need / 1e9, len(fitting), len(grid.points()),
                time.perf_counter() - t_start)
    with torch.inference_mode():
        for b, c in grid.points():
            if (b, c) not in fitting:
                res.skipped.append((b, c))
                continue
            predicted = est.point_s(grid, tp, b, c, graph) * (calib[0] / calib[1] if calib[1] else 1.0)
            if not budget.allows(predicted):
                res.stopped_at = (b, c)
                logger.warning("%s tp=%d: time budget stops before batch=%d context=%d (predicted %.2f s, %.1f s "
                               "left of this TP's share)", model, tp, b, c, predicted, budget.left())
                break
            t0 = time.perf_counter()
            try:
                eager, timed_graph = _measure_point(step, buffer, b, c, grid, device=device, graph=graph)
            except torch.cuda.OutOfMemoryError as e:  # activations or graph pool beyond the reserve: not a point
                res.out_of_memory.append((b, c))
                logger.warning("%s tp=%d batch=%d context=%d: out of memory, skipped (%s)", model, tp, b, c,
                               str(e).splitlines()[0])
                torch.cuda.empty_cache()
                continue
            wall = time.perf_counter() - t0
            calib[0] += wall
            calib[1] += est.point_s(grid, tp, b, c, graph)
            res.points.append(PointResult(
                batch=b, context=c, eager=(eager.median_s, eager.min_s, eager.max_s),
                graph=None if timed_graph is None else (timed_graph.median_s, timed_graph.min_s, timed_graph.max_s),
                wall_s=wall))
            graph_ms = "" if timed_graph is None else f", graph {timed_graph.median_s * 1e3:.3f} ms"
            logger.info("%s tp=%d batch=%d context=%d: eager %.3f ms%s (%.2f s)", model, tp, b, c,
                        eager.median_s * 1e3, graph_ms, wall)
    res.wall_s = time.perf_counter() - t_start
    return res


def _measure_point(step, buffer, batch: int, context: int, grid: GpuGrid, *, device, graph: bool):
    """(eager Timing, CUDA-graph Timing or None) of `batch` requests whose new token is at position context - 1."""
    import torch

    from pat_rollout.profile.gpu_step import capture_graph, time_steps

    ids = torch.randint(0, step.shape.vocab_rows, (batch,), device=device)
    pos = torch.full((batch,), context - 1, device=device, dtype=torch.long)
    kv = step.kv_view(buffer, batch, context)

    def one_step():
        return step.forward(ids, pos, kv)

    kw = {"device": device, "warmup": grid.warmup, "repeats": grid.repeats, "steps_per_repeat": grid.steps_per_repeat}
    eager = time_steps(one_step, **kw)
    if not graph:
        return eager, None
    g = capture_graph(one_step)  # its memory pool goes with it when this returns
    return eager, time_steps(g.replay, **kw)


def _spin_up(device, seconds: float = 1.0) -> None:
    """GEMMs for a second before the first point: an idle GPU sits at low clocks (345 MHz seen on an idle H200
    here), and the first points would time the ramp."""
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ a
        torch.cuda.synchronize(device)


def _release(device) -> None:
    """Hand the last TP size's weights and KV back to the driver, so the next one's free-memory reading (its KV
    room) counts them; called once measure_tp's frame (and every closure over its tensors) is gone."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _env(device, dtype) -> dict:
    import torch

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"{os.uname().machine} CPU"
    return {"hardware": f"1x {name} (one rank of each TP size, timed alone)", "device": name,
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "hbm_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
            "dtype": str(dtype).removeprefix("torch."), "date": time.strftime("%Y-%m-%d")}


def run(models: list[str], grid: GpuGrid, *, device_name: str, dtype_name: str, graph: bool | None,
        max_seconds: float, out_dir: Path, tag: str | None, reserve_bytes: float, kv_limit_bytes: float | None,
        ar_variant: str, sdpa: str | None = None, clock=time.perf_counter) -> list[Path]:
    """Measure every model in turn, each TP size within its share of `max_seconds`; write one profile per model
    (after every TP size). Returns the paths written."""
    import torch

    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    graph = device.type == "cuda" if graph is None else graph
    if graph and device.type != "cuda":
        raise ValueError(f"graph=True needs a CUDA device, got device={device_name!r}")
    sdpa = sdpa or ("flash" if device.type == "cuda" else "auto")
    env = {**_env(device, dtype), "sdpa": sdpa}
    if device.type == "cuda":
        _spin_up(device)
    tag = tag or ("cpu" if device.type == "cpu" else device_tag(env["device"]))
    budget = Budget.start(max_seconds, clock)
    t_run = clock()
    cost = {(m, tp): _tp_cost(m, tp, grid, graph) for m in models for tp in grid.tps}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for i, model in enumerate(models):
        model_budget = budget.sub(sum(v for (m, _), v in cost.items() if m == model),
                                  sum(v for (m, _), v in cost.items() if m in models[i:]))
        path = out_dir / f"{tag}_{model}_measured.json"
        results: list[TpResult] = []
        calib = [0.0, 0.0]
        wrote = False
        for j, tp in enumerate(grid.tps):
            tp_budget = model_budget.sub(cost[(model, tp)], sum(cost[(model, t)] for t in grid.tps[j:]))
            results.append(measure_tp(model, tp, grid, device=device, dtype=dtype, graph=graph, sdpa=sdpa,
                                      reserve_bytes=reserve_bytes, kv_limit_bytes=kv_limit_bytes, budget=tp_budget,
                                      calib=calib))
            _release(device)
            profile = build_profile(model, grid, results, env=env, graph=graph, ar_variant=ar_variant,
                                    wall_s=clock() - t_run, max_seconds=max_seconds)
            if profile["decode"]:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(profile, indent=1))
                tmp.replace(path)  # atomic: a killed run leaves the last complete file
                wrote = True
        if wrote:
            written.append(path)
            for row in profile["meta"]["tp_efficiency"]:
                logger.info("%s: TP%d per-GPU throughput vs TP1 at batch %d, context %d: %.3f (%s of the published "
                            "bracket)%s", model, row["tp"], row["batch"], row["context"], row["eff"], row["bracket"],
                            " [filled point]" if row["filled"] else "")
        else:
            logger.error("%s: nothing measured to write (omitted: %s)", model, profile["meta"]["omitted_tps"])
    return written


def _tp_cost(model: str, tp: int, grid: GpuGrid, graph: bool) -> float:
    """Estimated seconds of one TP size on an H200 with the device's memory free (weights and a reserve off)."""
    spec = MODELS[model][1]
    shape = rank_shape(spec, tp, max_tp=max(grid.tps))
    room = GPUS["h200"][1] - shape.weight_bytes - 6 * GIB
    est = StepEstimate(spec)
    return 2.0 + sum(est.point_s(grid, tp, b, c, graph) for b, c in grid.points() if fits(spec, shape, b, c, room))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Time one rank's decode step at TP=k shard shapes on one device.")
    ap.add_argument("--models", default="llama31_8b,qwen3_14b", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--tps", type=_ints, default=DEFAULT_TPS)
    ap.add_argument("--batches", type=_ints, default=DEFAULT_BATCHES)
    ap.add_argument("--contexts", type=_ints, default=DEFAULT_CONTEXTS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps-per-repeat", type=int, default=3)
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--no-graph", action="store_true", help="eager only (always so on CPU)")
    ap.add_argument("--sdpa", choices=("flash", "auto"), default=None,
                    help="SDPA kernel: flash (FlashAttention-2 only; the CUDA default) or auto (torch picks; CPU)")
    ap.add_argument("--max-seconds", type=float, default=420.0,
                    help="wall budget of the measuring (start-up excluded); each model and TP size gets a share, "
                         "and a point predicted to overrun it is not started")
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="device memory kept free of KV (activations, "
                                                                     "logits, graph pools)")
    ap.add_argument("--kv-limit-mib", type=float, default=None, help="cap on KV bytes per point (CPU default 256)")
    ap.add_argument("--ar-variant", choices=("low", "central", "high"), default="central",
                    help="which published all-reduce latency (15 / 11 / 7 us) the collective term uses")
    ap.add_argument("--out-dir", default="pat_rollout/profile/data")
    ap.add_argument("--tag", default=None, help="file name prefix (default: the device, e.g. h200, or cpu)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time; measure nothing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known {sorted(MODELS)}")
    grid = GpuGrid(tps=args.tps, batches=args.batches, contexts=args.contexts, warmup=args.warmup,
                   repeats=args.repeats, steps_per_repeat=args.steps_per_repeat)
    kv_limit = None if args.kv_limit_mib is None else args.kv_limit_mib * (1 << 20)
    if args.dry_run:
        _print_plan(models, grid, not args.no_graph, args.reserve_gib * GIB, kv_limit, args.max_seconds)
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    graph = False if args.no_graph or device == "cpu" else None
    paths = run(models, grid, device_name=device, dtype_name=args.dtype, graph=graph, max_seconds=args.max_seconds,
                out_dir=Path(args.out_dir), tag=args.tag, reserve_bytes=args.reserve_gib * GIB,
                kv_limit_bytes=kv_limit, ar_variant=args.ar_variant, sdpa=args.sdpa)
    for p in paths:
        print(f"wrote {p}")


def _print_plan(models: list[str], grid: GpuGrid, graph: bool, reserve: float, kv_limit: float | None,
                max_seconds: float) -> None:
    budgets = {}
    for m in models:
        spec = MODELS[m][1]
        for tp in grid.tps:
            shape = rank_shape(spec, tp, max_tp=max(grid.tps))
            room = kv_budget_bytes(GPUS["h200"][1] - shape.weight_bytes, reserve)
            budgets[(m, tp)] = room if kv_limit is None else min(room, kv_limit)
            skipped = [p for p in grid.points() if not fits(spec, shape, *p, budgets[(m, tp)])]
            print(f"{m} tp={tp}: heads {shape.num_heads}, kv heads {shape.num_kv_heads} (x{shape.kv_replication}), "
                  f"intermediate {shape.intermediate_size}, vocab rows {shape.vocab_rows}, weights "
                  f"{shape.weight_bytes / 1e9:.2f} GB; {len(grid.points()) - len(skipped)} points, "
                  f"{len(skipped)} skipped (KV > {budgets[(m, tp)] / 1e9:.1f} GB)")
    est = estimate_run_s(models, grid, kv_budget=budgets, graph=graph)
    print(f"estimated {est:.0f} s on an H200 (start-up included; the run is held to --max-seconds {max_seconds:.0f})")


if __name__ == "__main__":
    main()
