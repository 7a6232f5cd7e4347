"""Peak extra bytes and time of the SGLang pool's switches, before vs after a change (real SGLang, CPU).

    # one measurement of the code on PYTHONPATH (the sgl_kernel stand-in of the tests on the path too):
    PYTHONPATH=$PWD:tests/sglang_backend/sgl_kernel_stub python -m pat_rollout.bench.switch_memory --once
    # interleaved before/after runs, medians and spreads (BEFORE: a checkout of the old commit, e.g. `git archive`):
    PYTHONPATH=$PWD:tests/sglang_backend/sgl_kernel_stub python -m pat_rollout.bench.switch_memory \\
        --before /tmp/pat_before --runs 3

A 2-rank SglPool (llama-demo, float32, KV migration forced, transfer_chunk_bytes 1 MiB where the code has it)
decodes a batch; mid-decode it grows 2 x TP1 -> 1 x TP2
and shrinks back. In every scheduler process a start-up hook (a `sitecustomize` on PYTHONPATH, so the old code is
measured the same way without its own spy) wraps `pool_switch.gather_kv` (the KV exchange: export, transfer and the
received KV) and `pool_switch.reshard_local` in `comm.alloc_spy.AllocSpy`: the peak bytes of tensor storage they
allocate (on the CPU everything is host memory; gloo's own buffers are not counted). Times are the driver's
`ReconfigResult.total_s` (abort, exchange, reshard, rebuild, resubmit). Reported per switch: max over ranks, then
median and [min, max] over runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOOK = '''
import importlib.abc, importlib.util, json, os, sys
_DIR = os.environ.get("PAT_BENCH_SPY_DIR")
if _DIR:
    def _wrap(fn, what):
        from pat_bench_alloc_spy import AllocSpy
        def wrapped(*a, **kw):
            with AllocSpy() as spy:
                out = fn(*a, **kw)
            with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"what": what, "peak": spy.peak}) + "\\n")
            return out
        return wrapped
    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "pat_rollout.sglang.pool_switch":
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            orig = spec.loader.exec_module
            def exec_module(module):
                orig(module)
                module.gather_kv = _wrap(module.gather_kv, "kv")
                module.reshard_local = _wrap(module.reshard_local, "reshard")
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Finder())
'''


def _requests(n: int, prompt: int, max_new: int):
    from pat_rollout.types import Request, SamplingParams

    return [Request(request_id=f"m{i}", prompt_token_ids=tuple((7 * i + j) % 4000 + 3 for j in range(prompt)),
                    sampling=SamplingParams(max_new_tokens=max_new, ignore_eos=True)) for i in range(n)]


def once(args) -> dict:
    """One run of the code on PYTHONPATH: both switches' times and, per rank, the hooked peaks."""
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.models import make_tiny_model

    spy_dir = os.environ["PAT_BENCH_SPY_DIR"]
    path = str(make_tiny_model(Path(os.path.expanduser("~/.cache/pat_rollout/models")) / args.model, args.model))
    extra = {}
    if args.chunk_bytes and "transfer_chunk_bytes" in {f.name for f in dataclasses.fields(PatRolloutConfig)}:
        extra["transfer_chunk_bytes"] = args.chunk_bytes  # the code before #34 has no chunks: its default
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", kv_handoff="migrate", dtype="float32", steps_per_poll=2, **extra)
    driver = RolloutDriver(cfg)
    times = {}
    try:
        futures = {r.request_id: driver.submit(r) for r in _requests(args.batch, args.prompt, args.max_new)}
        for name, tp, n in (("grow", 2, 4), ("shrink", 1, 12)):
            t0 = time.time()
            while not all(f.done() or (rid in driver._progress and driver._progress[rid].num_output_tokens >= n)
                          for rid, f in futures.items()):
                if time.time() - t0 > 600:
                    raise TimeoutError(f"no {n} tokens before the {name}")
                time.sleep(0.02)
            driver.reconfigure(tp)
            times[name] = driver.last_reconfig.total_s
            times[f"{name}_migrated"] = len(driver.last_reconfig.migrated)
            times[f"{name}_phases"] = {k: round(v, 3) for k, v in driver.last_reconfig.phase_s.items()}
        for f in futures.values():
            f.result(timeout=600)
    finally:
        driver.shutdown()
    peaks: dict[str, list[int]] = {"grow_kv": [], "grow_reshard": [], "shrink_kv": [], "shrink_reshard": []}
    for file in sorted(Path(spy_dir).glob("*.jsonl")):
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        kv = [r["peak"] for r in rows if r["what"] == "kv"]
        rs = [r["peak"] for r in rows if r["what"] == "reshard"]
        if len(kv) == 2 and len(rs) == 2:  # a scheduler rank: grow then shrink
            peaks["grow_kv"].append(kv[0])
            peaks["shrink_kv"].append(kv[1])
            peaks["grow_reshard"].append(rs[0])
            peaks["shrink_reshard"].append(rs[1])
    if len(peaks["grow_kv"]) != 2:
        raise RuntimeError(f"expected spy records of 2 ranks in {spy_dir}, got {peaks}")
    return dict(times=times, peaks={k: max(v) for k, v in peaks.items()})


def _run_variant(code_dir: str, hook_dir: str, args) -> dict:
    stub = str(Path(__file__).resolve().parents[2] / "tests" / "sglang_backend" / "sgl_kernel_stub")
    with tempfile.TemporaryDirectory(prefix="pat-spy-") as spy_dir:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([hook_dir, code_dir, stub]), PAT_BENCH_SPY_DIR=spy_dir)
        cmd = [sys.executable, "-m", "pat_rollout.bench.switch_memory", "--once-json", "--model", args.model,
               "--batch", str(args.batch), "--prompt", str(args.prompt), "--max-new", str(args.max_new),
               "--chunk-bytes", str(args.chunk_bytes)]
        # the runner is this file (it may not exist in the old checkout): run it from here, the code from code_dir
        cmd = [sys.executable, str(Path(__file__).resolve())] + cmd[3:]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=code_dir)
        if out.returncode:
            raise RuntimeError(f"run in {code_dir} failed:\n{out.stderr[-4000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def _hook_dir() -> str:
    d = tempfile.mkdtemp(prefix="pat-bench-hook-")
    Path(d, "sitecustomize.py").write_text(HOOK)
    spy_src = Path(__file__).resolve().parents[1] / "comm" / "alloc_spy.py"
    Path(d, "pat_bench_alloc_spy.py").write_text(spy_src.read_text())
    return d


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="checkout of the old code (compared with this one, runs interleaved)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--once", action="store_true", help="one run of this code, printed")
    ap.add_argument("--once-json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="llama-demo")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20,
                    help="PatRolloutConfig.transfer_chunk_bytes where the code has it (0: its default)")
    args = ap.parse_args(argv)
    if args.once_json:
        print(json.dumps(once(args)))
        return
    hook = _hook_dir()
    here = str(Path(__file__).resolve().parents[2])
    variants = {"after": here} if args.once or not args.before else {"before": args.before, "after": here}
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(1 if args.once else args.runs):
        for name, code in variants.items():  # interleaved: before, after, before, after, ...
            r = _run_variant(code, hook, args)
            results[name].append(r)
            print(f"run {i} {name}: {json.dumps(r)}", flush=True)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} CPUs)")
    print("| metric | " + " | ".join(f"{v} median [min, max]" for v in variants) + " |")
    print("|---|" + "---|" * len(variants))
    for metric in ("shrink_reshard", "shrink_kv", "grow_kv", "grow_reshard"):
        cells = []
        for v in variants:
            xs = [r["peaks"][metric] for r in results[v]]
            cells.append(f"{_fmt_bytes(statistics.median(xs))} [{_fmt_bytes(min(xs))}, {_fmt_bytes(max(xs))}]")
        print(f"| peak extra bytes, {metric.replace('_', ' ')} | " + " | ".join(cells) + " |")
    for metric in ("grow", "shrink"):
        cells = []
        for v in variants:
            xs = [r["times"][metric] for r in results[v]]
            cells.append(f"{statistics.median(xs):.3f} s [{min(xs):.3f}, {max(xs):.3f}]")
        print(f"| switch time, {metric} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
