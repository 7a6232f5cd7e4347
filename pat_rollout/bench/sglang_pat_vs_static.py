"""PAT and the PAT pool's static layouts vs unmodified `sglang.Engine`s at each static TP, on one DeepScaleR-like stage.

    # GPU (2+ GPUs, a local HF checkpoint; greedy, lengths from the trace, ignore_eos):
    python -m pat_rollout.bench.sglang_pat_vs_static --model /models/Qwen3-8B --devices 2 \\
        --num-prompts 32 --samples 8 --max-new-tokens 8192 --profile h100_qwen3_14b
    # CPU run (tiny random model; the sgl_kernel stand-in of the tests on the path):
    PYTHONPATH=tests/sglang_backend/sgl_kernel_stub python -m pat_rollout.bench.sglang_pat_vs_static --tiny llama \\
        --num-prompts 4 --samples 2 --max-new-tokens 64 --repeats 3

Everything runs in one process, all alive at once, interleaved round by round (order reversed every other round):
- stock: unmodified `sglang.Engine`s (`bench.sglang_stock`) with the pool's launch settings (overlap scheduling on
  as in the pool, off with `--stock-no-overlap`): N TP1 engines (one core / device each) and one TPN engine;
- pool static: one SglPool per static TP (base layout = that TP, never switched), driven by the same code as the
  stock engines (`Replicas`), so their ratio is the pool's own cost per decode step (goal <= 1.05);
- PAT: a RolloutDriver (planner on `--profile`, start at TP1) generating the stage.
Prints (1) the decode step time of a uniform batch, pool static over stock at each TP (per-round ratios: median
and min-max), and (2) the stage's generation time of every policy over the best stock static layout. Medians and
spreads only, never gated on absolute times. PAT's ratio only means something on the hardware `--profile`
describes (measure one with `python -m pat_rollout.profile`).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

from pat_rollout.bench.side_by_side import print_reconfigs
from pat_rollout.config import PatRolloutConfig
from pat_rollout.sim.traces import deepscaler_like, verl_like
from pat_rollout.types import Request, RequestOutput, SamplingParams


def trace_requests(trace_name: str, *, num_prompts: int, samples: int, max_new_tokens: int, vocab: int,
                   seed: int = 0) -> list[Request]:
    """One stage of the trace as requests: random prompt tokens of the trace's prompt lengths, and each
    response forced to the trace's length (ignore_eos), so every run decodes the same amount."""
    make = {"deepscaler": deepscaler_like, "verl": verl_like}[trace_name]
    trace = make(num_prompts=num_prompts, samples_per_prompt=samples, max_new_tokens=max_new_tokens, seed=seed)
    rng = random.Random(seed)
    prompts: dict[str, tuple[int, ...]] = {}
    reqs = []
    for i, rec in enumerate(trace.records):
        if rec.prompt_id not in prompts:
            prompts[rec.prompt_id] = tuple(rng.randrange(3, vocab) for _ in range(min(rec.prompt_len, 512)))
        reqs.append(Request(request_id=f"{rec.prompt_id}-{i}", prompt_token_ids=prompts[rec.prompt_id],
                            sampling=SamplingParams(max_new_tokens=rec.response_len, ignore_eos=True)))
    return reqs


def uniform_batch(num_requests: int, prompt_len: int, max_new_tokens: int, vocab: int, seed: int = 1) -> list[Request]:
    """Requests of one prompt length and one response length (ignore_eos): every one decodes in every step."""
    rng = random.Random(seed)
    return [Request(request_id=f"u{i}", prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(prompt_len)),
                    sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
            for i in range(num_requests)]


def _spread(xs: list[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    return f"{statistics.median(xs) * scale:{fmt}} [{min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}}]"


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (a shared machine's timings mean little without them)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="local HF checkpoint (Llama or Qwen3)")
    src.add_argument("--tiny", help="tiny random preset made locally (llama, qwen3, llama-demo)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--trace", default="deepscaler", choices=["deepscaler", "verl"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8192)
    ap.add_argument("--step-batch", type=int, default=8, help="requests in the uniform decode-step batch")
    ap.add_argument("--step-tokens", type=int, default=64, help="tokens each request of that batch decodes")
    ap.add_argument("--profile", default="h100_llama31_8b", help="latency profile for the PAT planner")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--kv-handoff", default="auto", choices=["auto", "migrate", "recompute"])
    ap.add_argument("--stock-no-overlap", action="store_true",
                    help="stock engines without SGLang's overlap scheduler (default: on, as the pool runs)")
    ap.add_argument("--mem-fraction", type=float, default=0.15,
                    help="GPU only: SGLang mem_fraction_static of every engine (5 share each device)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians and min-max are shown")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    import torch

    gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.tiny:
        from pat_rollout.models import make_tiny_model

        path = str(make_tiny_model(Path(os.path.expanduser("~/.cache/pat_rollout/models")) / args.tiny, args.tiny))
    else:
        path = args.model
    from pat_rollout.sglang.pool import check_model

    n = args.devices
    # All engines live at once: on GPU, per device one stock TP1 engine, the stock TPN one, two static pools and
    # the PAT pool share its memory, so each gets `--mem-fraction` of it.
    engine_args = {} if not gpu else {"mem_fraction_static": args.mem_fraction}
    common = dict(model_path=path, num_devices=n, backend="sglang", dtype=dtype, kv_handoff=args.kv_handoff,
                  steps_per_poll=8, profile_path=args.profile, engine_args=engine_args)
    spec = check_model(PatRolloutConfig(policy="static", initial_tp=1, **common))
    requests = trace_requests(args.trace, num_prompts=args.num_prompts, samples=args.samples,
                              max_new_tokens=args.max_new_tokens, vocab=spec.vocab_size)
    batch = uniform_batch(args.step_batch, 16, args.step_tokens, spec.vocab_size)
    lens = sorted(r.sampling.max_new_tokens for r in requests)
    print(f"{args.trace}-like stage: {len(requests)} requests, response lengths median {lens[len(lens) // 2]} / "
          f"max {lens[-1]}; decode-step batch: {len(batch)} x {args.step_tokens} tokens; {n} "
          f"{'GPUs' if gpu else 'CPU ranks'}, {dtype}, model {path}; load average before: {loadavg()}", flush=True)
    results = run_rounds(args, common, spec, requests, batch, device="cuda" if gpu else "cpu")
    print(f"load average after: {loadavg()}")
    if not results:
        sys.exit("FAIL: greedy outputs differ (see 'same tokens' above)")


def run_rounds(args, common: dict, spec, requests: list[Request], batch: list[Request], device: str) -> bool:
    """Start every engine, warm each up, run the interleaved rounds, print both tables; True if every greedy
    output agreed (pool static vs stock at each TP on the batch; every policy vs the first on the stage)."""
    from pat_rollout.bench.sglang_stock import Replicas, launch_stock_engine
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.engine import SGLangEngine
    from pat_rollout.sglang.pool import SglPool

    n, tps = args.devices, sorted({1, args.devices})
    closers: list = []
    try:
        stock: dict[int, Replicas] = {}
        pool: dict[int, Replicas] = {}
        for tp in tps:
            print(f"starting stock sglang.Engine x{n // tp} at TP{tp} ...", flush=True)
            engines = []
            cfg = PatRolloutConfig(policy="static", initial_tp=tp, **common)
            for i in range(n // tp):
                sgl = launch_stock_engine(common["model_path"], tp_size=tp, device=device, index=i,
                                          dtype=common["dtype"], random_seed=cfg.seed,
                                          disable_overlap_schedule=args.stock_no_overlap, **common["engine_args"])
                engines.append(SGLangEngine(common["model_path"], tp_size=tp, sgl=sgl))
                closers.append(engines[-1].shutdown)
            stock[tp] = Replicas([(e, 0) for e in engines])
            print(f"starting SglPool static {n // tp}xTP{tp} ...", flush=True)
            p = SglPool(cfg, spec, Layout.uniform(n, tp), device=device)
            closers.append(p.shutdown)
            pool[tp] = Replicas([(p.client, r) for r in range(n // tp)])
        print("starting PAT (RolloutDriver) ...", flush=True)
        pat_cfg = PatRolloutConfig(policy="pat", initial_tp=1, candidate_tps=(1, n), **common)
        pat = RolloutDriver(pat_cfg)
        closers.append(pat.shutdown)

        warm = batch[:2]
        for r in [*stock.values(), *pool.values()]:
            r.generate(warm)
        pat.generate(warm)

        def run_pat(reqs: list[Request]) -> tuple[list[RequestOutput], float]:
            pat.reconfigure(pat_cfg.initial_tp)  # every RL stage starts in the base layout
            t0 = time.perf_counter()
            outs = pat.generate(reqs)
            return outs, time.perf_counter() - t0

        step: dict[str, list[float]] = {}
        batch_tokens: dict[str, list] = {}
        stage_runs = {**{f"stock {n // tp}xTP{tp}": stock[tp].generate for tp in tps},
                      **{f"pool static {n // tp}xTP{tp}": pool[tp].generate for tp in tps}, "PAT": run_pat}
        stage_s: dict[str, list[float]] = {k: [] for k in stage_runs}
        stage_tokens: dict[str, list] = {k: [] for k in stage_runs}
        for rnd in range(args.repeats):
            order = [(side, tp) for tp in tps for side in ("stock", "pool")]
            for side, tp in order if rnd % 2 == 0 else order[::-1]:
                reps = (stock if side == "stock" else pool)[tp]
                outs, _s = reps.generate(batch)
                step.setdefault(f"{side} TP{tp}", []).append(reps.median_step_s())
                batch_tokens.setdefault(f"{side} TP{tp}", []).append([o.token_ids for o in outs])
            names = list(stage_runs) if rnd % 2 == 0 else list(stage_runs)[::-1]
            for name in names:
                outs, secs = stage_runs[name](requests)
                stage_s[name].append(secs)
                stage_tokens[name].append([o.token_ids for o in outs])
            print(f"round {rnd + 1}/{args.repeats} done; load average {loadavg()}", flush=True)
        ok = print_step_table(tps, n, step, batch_tokens)
        ok &= print_stage_table(stage_s, stage_tokens)
        print_reconfigs("PAT", pat.stage_metrics())
        return ok
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as e:  # keep shutting the others down
                logging.getLogger(__name__).warning("shutdown failed: %s", e)


def print_step_table(tps: list[int], n: int, step: dict[str, list[float]], tokens: dict[str, list], *,
                     title: str = "decode step time of the uniform batch (ms per token of a request after its first "
                                  "chunk; median over requests, then median [min-max] over rounds)",
                     stock_label: str = "stock sglang", scale: float = 1e3) -> bool:
    """Per TP: pool static and stock times (`step[f"pool TP{tp}"]`, `step[f"stock TP{tp}"]`, one per round, shown
    times `scale`) and the per-round ratios, median [min-max]; True if every round's tokens equal stock's first."""
    print(f"\n{title}")
    print(f"{'layout':<10}{'pool static':>26}{stock_label:>26}{'pool / stock':>24}{'same tokens':>13}")
    ok = True
    for tp in tps:
        p, s = step[f"pool TP{tp}"], step[f"stock TP{tp}"]
        same = all(t == tokens[f"stock TP{tp}"][0] for t in tokens[f"pool TP{tp}"] + tokens[f"stock TP{tp}"])
        ok &= same
        ratios = [a / b for a, b in zip(p, s)]
        print(f"{f'{n // tp}xTP{tp}':<10}{_spread(p, scale):>26}{_spread(s, scale):>26}{_spread(ratios, 1, '.3f'):>24}"
              f"{str(same):>13}")
    print("(pool / stock: per-round ratios; goal <= 1.05)")
    return ok


def print_stage_table(secs: dict[str, list[float]], tokens: dict[str, list]) -> bool:
    best = min(statistics.median(v) for k, v in secs.items() if k.startswith("stock"))
    ref = next(iter(tokens.values()))[0]
    width = max(map(len, secs)) + 2
    print(f"\n{'policy':<{width}}{'gen time s':>24}{'vs best stock static':>22}{'same tokens':>13}")
    ok = True
    for name, v in secs.items():
        same = all(t == ref for t in tokens[name])
        ok &= same
        print(f"{name:<{width}}{_spread(v):>24}{statistics.median(v) / best:>22.3f}{str(same):>13}")
    print("(gen time: median [min-max] over rounds; ratio of medians)")
    return ok


if __name__ == "__main__":
    main()
