"""The vLLM pool's static layouts vs unmodified vLLM engines at the same TP, and PAT's stage, on one skewed batch.

    # in the vLLM venv (make install-vllm), CPU: a tiny random Llama (head_dim 32), 2 devices = 2 cores
    python -m pat_rollout.bench.vllm_stock            # ~10 min on 2 loaded cores
    python -m pat_rollout.bench.vllm_stock --quick    # smoke run: 2 short rounds (~5 min: 7 engine starts)

Per static layout (2 x TP1, then 1 x TP2), one phase with two configurations alive at once, each started once and
reused for every round:
- pool static: a `VllmPool` held in that layout (never switched), driven replica by replica with `VllmPool.step`
  (its bounded polling and bookkeeping included);
- stock: unmodified `vllm.v1.engine.llm_engine.LLMEngine`s, one per replica, with the pool's engine args (TP,
  dtype, max_num_seqs, enforce_eager, seed, max_model_len; no pat_rollout worker extension) and the pool's
  placement environment per replica (2 x TP1: two engines, one core each, side by side), driven with
  `LLMEngine.step`.
Both get the same requests (token ids, greedy, fixed response lengths: a few long, many short) dealt to replicas
the same way, in rounds interleaved pool, stock, stock, pool, ... so drift hits both. Per round: each request's
decode step time ((last token - first token) / tokens after the first, as the driver sees them; `ChunkClock`),
median over requests, and the stage's time from submission to the last output. Printed: median [min-max] over
rounds and the per-round ratio pool / stock (goal <= 1.05), and whether greedy tokens are equal.
Then PAT: a `RolloutDriver` (backend vllm, planner on, start at TP1) generates the same stage, after the static
phases (not interleaved with them). On this CPU a PAT switch restarts engines (tens of seconds each), so PAT loses
to both statics here; the number says what the first-step pool costs, not what PAT gains on a GPU.
Medians and spreads only; nothing is gated on times. Exits non-zero if greedy tokens differ.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pat_rollout.bench.sglang_pat_vs_static import loadavg, print_stage_table, print_step_table
from pat_rollout.bench.sglang_stock import ChunkClock
from pat_rollout.config import PatRolloutConfig
from pat_rollout.types import Request, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


def skewed_batch(num_requests: int, num_long: int, short_tokens: int, long_tokens: int, vocab: int,
                 seed: int = 1) -> list[Request]:
    """Greedy requests with random prompts of 8-64 tokens; the first `num_long` decode `long_tokens`, the others
    `short_tokens` (ignore_eos: fixed lengths), so the stage ends with a long tail of few requests."""
    rng = random.Random(seed)
    return [Request(request_id=f"s{i}",
                    prompt_token_ids=tuple(rng.randrange(3, vocab) for _ in range(rng.randrange(8, 65))),
                    sampling=SamplingParams(max_new_tokens=long_tokens if i < num_long else short_tokens,
                                            ignore_eos=True))
            for i in range(num_requests)]


def deal(requests: list[Request], num_replicas: int) -> dict[int, list[Request]]:
    """Requests dealt round-robin over the replicas (both sides get the same assignment)."""
    return {r: requests[r::num_replicas] for r in range(num_replicas)}


def record(clock: ChunkClock, seen: dict[str, int], rid: str, num_tokens: int, now: float) -> None:
    """Log a request's new tokens (cumulative count `num_tokens`) as one chunk at `now`."""
    new = num_tokens - seen.get(rid, 0)
    if new > 0:
        clock.chunks.setdefault(rid, []).append((now, new))
        seen[rid] = num_tokens


class StockEngines:
    """Unmodified vLLM `LLMEngine`s, one per replica of `layout`, started in the pool's placement environment."""

    def __init__(self, args: dict[str, Any], groups: list[tuple[int, ...]], num_devices: int, device: str,
                 eos_token_ids: tuple[int, ...], seed: int) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from pat_rollout.vllm.pool import replica_env, replica_seed
        from pat_rollout.vllm.replica import patched_environ

        stock = {k: v for k, v in args.items() if k != "worker_extension_cls"}
        self.eos_token_ids = eos_token_ids
        self.engines: list[Any] = []
        for r, group in enumerate(groups):
            eargs = EngineArgs(**{**stock, "seed": replica_seed(seed, 0, r)}, tensor_parallel_size=len(group))
            with patched_environ(replica_env(group, num_devices, device)):
                self.engines.append(LLMEngine.from_engine_args(eargs))

    def generate(self, requests: list[Request], clock: ChunkClock) -> tuple[list[RequestOutput], float]:
        from vllm.inputs import TokensPrompt

        from pat_rollout.vllm.replica import vllm_sampling

        clock.clear()
        seen: dict[str, int] = {}
        outs: dict[str, RequestOutput] = {}
        got: dict[str, tuple[list[int], list[float]]] = {q.request_id: ([], []) for q in requests}
        t0 = time.perf_counter()
        for r, reqs in deal(requests, len(self.engines)).items():
            for q in reqs:
                self.engines[r].add_request(q.request_id, TokensPrompt(prompt_token_ids=list(q.prompt_token_ids)),
                                            vllm_sampling(q.sampling, q.sampling.max_new_tokens, self.eos_token_ids))
        while busy := [e for e in self.engines if e.has_unfinished_requests()]:
            for eng in busy:
                step_outs = eng.step()
                now = time.perf_counter()
                for o in step_outs:  # DELTA outputs (vllm_sampling): the new tokens only
                    c = o.outputs[0]
                    ids, lps = got[o.request_id]
                    ids.extend(c.token_ids)
                    lps.extend(next(iter(d.values())).logprob for d in (c.logprobs or []))
                    record(clock, seen, o.request_id, len(ids), now)
                    if o.finished:
                        outs[o.request_id] = RequestOutput(
                            request_id=o.request_id, prompt_token_ids=tuple(o.prompt_token_ids or ()),
                            token_ids=tuple(ids), log_probs=tuple(lps), finish_reason=c.finish_reason or "")
        elapsed = time.perf_counter() - t0
        return [outs[q.request_id] for q in requests], elapsed

    def shutdown(self) -> None:
        for eng in self.engines:
            eng.engine_core.shutdown()


def pool_generate(pool: Any, requests: list[Request], clock: ChunkClock) -> tuple[list[RequestOutput], float]:
    """The same requests on a `VllmPool` (held in its layout), stepped replica by replica as the stock engines are."""
    clock.clear()
    seen: dict[str, int] = {}
    outs: dict[str, RequestOutput] = {}
    t0 = time.perf_counter()
    pool.add_requests(deal(requests, len(pool.replicas)))
    while busy := [r for r, rep in enumerate(pool.replicas) if rep.busy()]:
        for r in busy:
            ((res, _snap),) = pool.step([r], 1).values()
            now = time.perf_counter()
            for rid, t in pool.replicas[r].tracked.items():
                record(clock, seen, rid, t.num_tokens, now)
            for o in res.finished:
                record(clock, seen, o.request_id, len(o.token_ids), now)
                outs[o.request_id] = o
    elapsed = time.perf_counter() - t0
    return [outs[q.request_id] for q in requests], elapsed


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, shorter responses")
    ap.add_argument("--model", help="local HF checkpoint (default: the tests' tiny random Llama, head_dim 32)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--long", type=int, default=4, help="how many of the requests are long")
    ap.add_argument("--short-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per static layout")
    ap.add_argument("--pat-rounds", type=int, default=1, help="PAT stages (each restarts engines on CPU)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.long, args.rounds, args.short_tokens, args.long_tokens = 8, 2, 2, 12, 48
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV per CPU engine
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import torch

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.model:
        path = args.model
    else:
        from pat_rollout.models import make_tiny_model

        path = str(make_tiny_model(Path(os.path.expanduser("~/.cache/pat_rollout/models")) / "llama_hd32", "llama",
                                   hidden_size=128, head_dim=32))
    from pat_rollout.vllm.pool import check_model

    n = args.devices
    common = dict(model_path=path, num_devices=n, backend="vllm", dtype=dtype, kv_handoff="recompute")
    spec = check_model(PatRolloutConfig(policy="static", initial_tp=1, **common))
    requests = skewed_batch(args.requests, args.long, args.short_tokens, args.long_tokens, spec.vocab_size)
    import vllm

    print(f"vllm_stock: vLLM {vllm.__version__}, commit {commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"; {n} {'GPUs' if gpu else 'CPU devices (one core each)'}, {dtype}, model {path}; skewed stage: "
          f"{len(requests)} greedy requests, {args.long} x {args.long_tokens} + {len(requests) - args.long} x "
          f"{args.short_tokens} tokens; {args.rounds} interleaved rounds per layout; load average before: "
          f"{loadavg()}", flush=True)
    ok = run(args, common, spec, requests, device)
    print(f"load average after: {loadavg()}")
    if not ok:
        sys.exit("FAIL: greedy outputs differ (see 'same tokens' above)")


def run(args: argparse.Namespace, common: dict, spec: Any, requests: list[Request], device: str) -> bool:
    """Both static phases, then PAT; prints the tables; True if every greedy output agreed."""
    from pat_rollout.layout import Layout
    from pat_rollout.vllm.pool import VllmPool, engine_args

    n, tps = args.devices, sorted({1, args.devices})
    step: dict[str, list[float]] = {}
    stage: dict[str, list[float]] = {}
    step_tokens: dict[str, list] = {}
    stage_by_policy: dict[str, list[float]] = {}
    tokens_by_policy: dict[str, list] = {}
    warm = requests[-2:]
    for tp in tps:
        layout = Layout.uniform(n, tp)
        name = f"{n // tp}xTP{tp}"
        cfg = PatRolloutConfig(policy="static", initial_tp=tp, **common)
        closers: list[Callable[[], None]] = []
        try:
            t0 = time.perf_counter()
            print(f"starting VllmPool static {name} ...", flush=True)
            pool = VllmPool(cfg, spec, layout, device=device)
            closers.append(pool.shutdown)
            print(f"  up in {time.perf_counter() - t0:.0f} s; starting stock LLMEngine x{n // tp} at TP{tp} ...",
                  flush=True)
            t0 = time.perf_counter()
            stock = StockEngines(engine_args(cfg, spec), list(layout.groups), n, device, spec.eos_token_ids,
                                 cfg.seed)
            closers.append(stock.shutdown)
            print(f"  up in {time.perf_counter() - t0:.0f} s; load average {loadavg()}", flush=True)
            clock = ChunkClock()
            sides = {"pool": lambda reqs: pool_generate(pool, reqs, clock),
                     "stock": lambda reqs: stock.generate(reqs, clock)}
            for gen in sides.values():
                gen(warm)
            for rnd in range(args.rounds):
                for side in ("pool", "stock") if rnd % 2 == 0 else ("stock", "pool"):
                    outs, secs = sides[side](requests)
                    key = f"{side} TP{tp}"
                    step.setdefault(key, []).append(statistics.median(clock.step_times()))
                    stage.setdefault(key, []).append(secs)
                    step_tokens.setdefault(key, []).append([o.token_ids for o in outs])
                    policy = f"{'pool static' if side == 'pool' else 'stock'} {name}"
                    stage_by_policy.setdefault(policy, []).append(secs)
                    tokens_by_policy.setdefault(policy, []).append([o.token_ids for o in outs])
                print(f"{name} round {rnd + 1}/{args.rounds} done; load average {loadavg()}", flush=True)
        finally:
            close_all(closers)
    ok = print_step_table(tps, n, step, step_tokens, stock_label="stock vLLM",
                          title="decode step time of the skewed stage (ms per token of a request after its first; "
                                "median over requests, then median [min-max] over rounds)")
    ok &= print_step_table(tps, n, stage, step_tokens, stock_label="stock vLLM", scale=1.0,
                           title="stage time of the skewed stage (s from submission to the last output; median "
                                 "[min-max] over rounds)")
    if args.pat_rounds:
        ok &= run_pat(args, common, requests, stage_by_policy, tokens_by_policy)
    return ok


def run_pat(args: argparse.Namespace, common: dict, requests: list[Request], stage_by_policy: dict[str, list[float]],
            tokens_by_policy: dict[str, list]) -> bool:
    from pat_rollout.bench.side_by_side import print_reconfigs
    from pat_rollout.driver import RolloutDriver

    cfg = PatRolloutConfig(policy="pat", initial_tp=1, candidate_tps=(1, args.devices), **common)
    t0 = time.perf_counter()
    print(f"\nstarting PAT (RolloutDriver, backend vllm, planner profile {cfg.profile_path or 'default'}) ...",
          flush=True)
    pat = RolloutDriver(cfg)
    try:
        print(f"  up in {time.perf_counter() - t0:.0f} s", flush=True)
        for rnd in range(args.pat_rounds):
            pat.reconfigure(cfg.initial_tp)  # every RL stage starts in the base layout (outside the timing)
            t0 = time.perf_counter()
            outs = pat.generate(requests)
            stage_by_policy.setdefault("PAT", []).append(time.perf_counter() - t0)
            tokens_by_policy.setdefault("PAT", []).append([o.token_ids for o in outs])
            print(f"PAT round {rnd + 1}/{args.pat_rounds} done; load average {loadavg()}", flush=True)
        metrics = pat.stage_metrics()
    finally:
        close_all([pat.shutdown])
    print("\nthe skewed stage per policy (PAT after the static phases, not interleaved with them)")
    ok = print_stage_table(stage_by_policy, tokens_by_policy)
    print_reconfigs("PAT", metrics)
    return ok


def close_all(closers: list[Callable[[], None]]) -> None:
    for close in reversed(closers):
        try:
            close()
        except Exception as e:  # keep shutting the others down
            logger.warning("shutdown failed: %s", e)


if __name__ == "__main__":
    main()
