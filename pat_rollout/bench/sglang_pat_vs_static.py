"""Generation latency of PAT vs static TP on real SGLang engines, one DeepScaleR-like stage, measured side by side.

    # GPU (2+ GPUs, a local HF checkpoint; greedy, lengths from the trace, ignore_eos):
    python -m pat_rollout.bench.sglang_pat_vs_static --model /models/Qwen3-8B --devices 2 \\
        --num-prompts 32 --samples 8 --max-new-tokens 8192 --profile h100_qwen3_14b
    # CPU smoke run (tiny random model; the sgl_kernel stand-in of the tests on the path):
    PYTHONPATH=tests/sglang_backend/sgl_kernel_stub python -m pat_rollout.bench.sglang_pat_vs_static --tiny llama \\
        --num-prompts 4 --samples 2 --max-new-tokens 64

Runs static N x TP1, static 1 x TPN and PAT (planner on `--profile`, start at TP1) one after the other in one
process, each on a fresh SglPool, and prints generation time and the ratio to the best static layout. Ratios
only mean something for the hardware the profile describes (measure one with `python -m pat_rollout.profile`).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from pathlib import Path

from pat_rollout.bench.side_by_side import print_reconfigs, print_table, run_all
from pat_rollout.config import PatRolloutConfig
from pat_rollout.sim.traces import deepscaler_like, verl_like
from pat_rollout.types import Request, SamplingParams


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
    ap.add_argument("--profile", default="h100_llama31_8b", help="latency profile for the PAT planner")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--kv-handoff", default="auto", choices=["auto", "migrate", "recompute"])
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per policy on one driver; the median is shown")
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

    base = PatRolloutConfig(model_path=path, num_devices=args.devices, backend="sglang", dtype=dtype,
                            kv_handoff=args.kv_handoff, steps_per_poll=8, profile_path=args.profile)
    spec = check_model(base)
    requests = trace_requests(args.trace, num_prompts=args.num_prompts, samples=args.samples,
                              max_new_tokens=args.max_new_tokens, vocab=spec.vocab_size)
    lens = sorted(r.sampling.max_new_tokens for r in requests)
    print(f"{args.trace}-like stage: {len(requests)} requests, response lengths median {lens[len(lens) // 2]} / "
          f"max {lens[-1]}; {args.devices} {'GPUs' if gpu else 'CPU ranks'}, {dtype}, model {path}", flush=True)
    n = args.devices
    common = {k: getattr(base, k) for k in ("model_path", "num_devices", "backend", "dtype", "kv_handoff",
                                            "steps_per_poll", "profile_path")}
    runs = {f"static {n}xTP1": PatRolloutConfig(policy="static", initial_tp=1, **common),
            f"static 1xTP{n}": PatRolloutConfig(policy="static", initial_tp=n, **common),
            "PAT": PatRolloutConfig(policy="pat", initial_tp=1, candidate_tps=(1, n), **common)}
    # Warm-up on two requests: first batches, allocator, kernels.
    results = run_all(runs, requests, warmup=requests[:2], repeats=args.repeats)
    all_same = print_table(results)
    print_reconfigs("PAT", results["PAT"].metrics)
    if not all_same:
        sys.exit("FAIL: greedy outputs differ between runs (see 'same tokens' above)")


if __name__ == "__main__":
    main()
