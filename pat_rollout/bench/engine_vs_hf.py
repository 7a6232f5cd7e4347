"""Decode throughput of RefEngine vs HF `generate` on the same tiny model (CPU, greedy, float32).

    python -m pat_rollout.bench.engine_vs_hf [--arch llama-demo] [--batch 16] [--new 64] [--threads 1]

Both sides get the same batch of equal-length random prompts and generate exactly --new tokens
(EOS ignored), so the token counts match; prefill is included in both timings.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.ref import RefEngine, RefEngineConfig
from pat_rollout.models import make_tiny_model
from pat_rollout.types import Request, SamplingParams


def bench_ref(path: str, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    blocks = len(prompts) * -(-(len(prompts[0]) + new) // 16)
    engine = RefEngine(RefEngineConfig(model_path=path, dtype="float32", num_kv_blocks=blocks), TPContext())
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    warm = engine.generate([Request(request_id="warm", prompt_token_ids=tuple(prompts[0]), sampling=params)])
    assert len(warm[0].token_ids) == new
    start = time.perf_counter()
    outs = engine.generate(Request(request_id=str(i), prompt_token_ids=tuple(p), sampling=params)
                           for i, p in enumerate(prompts))
    return time.perf_counter() - start, [list(o.token_ids) for o in outs]


def bench_hf(path: str, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new)
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), **kwargs)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama-demo")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    # One intra-op thread by default: on a small shared CPU, OpenMP barriers of 2+ threads dominate.
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(f"{tmp}/{args.arch}", args.arch, init_std=0.02))
        ref_s, ref_tokens = bench_ref(path, prompts, args.new)
        hf_s, hf_tokens = bench_hf(path, prompts, args.new)
    num_tokens = args.batch * args.new
    same = sum(a == b for a, b in zip(ref_tokens, hf_tokens))
    print(f"{args.arch}: batch {args.batch}, prompt {args.prompt_len}, {args.new} new tokens, float32, "
          f"{args.threads} threads")
    print(f"{'engine':<10}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'RefEngine':<10}{ref_s:>10.3f}{num_tokens / ref_s:>12.1f}")
    print(f"{'HF':<10}{hf_s:>10.3f}{num_tokens / hf_s:>12.1f}")
    print(f"ratio RefEngine/HF: {hf_s / ref_s:.2f}x; identical greedy sequences: {same}/{args.batch} (fp32)")


if __name__ == "__main__":
    main()
