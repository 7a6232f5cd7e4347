"""One-GPU check of the switch's device mechanisms in pure torch (no SGLang): two processes share one GPU.

- a CUDA tensor given to a gloo group is refused (GlooTransport's check), and pinned-host staging
  (StagedTransport over gloo, what `transport_for("cuda")` picks) moves CUDA tensors exactly;
- a TP2 -> TP1 shrink of Llama-like shards on the GPU runs in place (same storages, bit-exact) with peak extra device
  memory (`torch.cuda.max_memory_allocated`) within one transfer chunk (+ the allocator's rounding), where
  assembling new shards took one TP1 shard per process;
- a KV hand-off of CUDA KV into host memory keeps device scratch within two chunks + one token's piece.

Skipped without CUDA. `PAT_GPU_TEST_DEVICE=cpu` runs the same script on the CPU (AllocSpy instead of the CUDA
allocator's statistics) to check the test itself.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEVICE = os.environ.get("PAT_GPU_TEST_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip(f"needs CUDA: torch {torch.__version__} sees no CUDA device", allow_module_level=True)

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

CHUNK = 1 << 20
SLACK = 1 << 20  # the CUDA caching allocator rounds blocks (512 B, 2 MiB for large ones)


class _Peak:
    """Peak extra device bytes inside the window: the CUDA allocator's statistics, or AllocSpy on the CPU."""

    def __enter__(self):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from pat_rollout.comm.alloc_spy import AllocSpy

            self.spy = AllocSpy().__enter__()
        return self

    def __exit__(self, *exc):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.spy.__exit__(*exc)
            self.peak = self.spy.peak


def _worker(rank: int, store: str, out: str) -> None:
    from pat_rollout.comm.transport import GlooTransport, StagedTransport, transport_for
    from pat_rollout.kv import plan_kv
    from pat_rollout.kv.apply import gather_kv
    from pat_rollout.layout import Layout, model_shard_specs, plan_weights
    from pat_rollout.reshard.apply import reshard_local, shard
    from pat_rollout.types import ModelSpec

    dev = torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu")
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    report: dict = {}
    try:
        gloo = GlooTransport(None)
        transport = transport_for(dev, gloo)
        report["staged"] = isinstance(transport, StagedTransport)
        # 1. the gloo check, then a staged round trip
        if DEVICE == "cuda":
            try:
                gloo.submit_send(torch.ones(4, device=dev), 1 - rank, 0)
                report["refused"] = False
            except TypeError:
                report["refused"] = True
        mine = torch.arange(1000, dtype=torch.float32, device=dev) + 1000 * rank
        got = torch.empty(1000, device=dev)
        transport.submit_send(mine, 1 - rank, 1)
        transport.submit_recv(got, 1 - rank, 1)
        transport.run()
        report["round_trip"] = bool(torch.equal(got.cpu(), torch.arange(1000, dtype=torch.float32) + 1000 * (1 - rank)))

        # 2. TP2 -> TP1 shrink in place; storages sized for TP1 (the pool's base layout)
        model = ModelSpec(arch="llama", num_layers=2, hidden_size=1024, num_heads=16, num_kv_heads=8, head_dim=64,
                          intermediate_size=2816, vocab_size=4096)
        specs = model_shard_specs(model, 2)
        gen = torch.Generator().manual_seed(0)
        full = {n: torch.randn(s.shape, generator=gen) for n, s in sorted(specs.items())}
        src, dst = Layout.uniform(2, 2), Layout.uniform(2, 1)
        shards = {}
        for n, s in specs.items():
            store_ = torch.empty(s.numel(), device=dev)
            local = shard(full[n], s, rank, 2)
            store_[: local.numel()].copy_(local.reshape(-1))
            shards[n] = store_[: local.numel()].view(local.shape)
        ptrs = {n: t.data_ptr() for n, t in shards.items()}
        plan = plan_weights(src, dst, specs)
        with _Peak() as peak:
            new = reshard_local(shards, plan, rank, transport, keep_storage=True, chunk_bytes=CHUNK)
        report["reshard_peak"] = peak.peak
        report["tp1_shard_bytes"] = sum(s.numel() * 4 for s in specs.values())
        report["reshard_exact"] = all(torch.equal(new[n].cpu(), full[n]) for n in specs)
        report["reshard_in_place"] = all(new[n].data_ptr() == ptrs[n] for n in specs)

        # 3. KV hand-off: CUDA KV of a 2-rank replica into host memory on both ranks (TP2 -> 2 x TP1 style)
        layers, heads, hd, tokens = 4, 8, 64, 2048
        kv = torch.randn(layers, 2, tokens, heads, hd, generator=torch.Generator().manual_seed(1))
        mine_kv = kv[:, :, :, rank * 4 : rank * 4 + 4].contiguous().to(dev)
        kv_plan = plan_kv([("r0", (0, 1), (0,), tokens), ("r1", (0, 1), (1,), tokens)], heads)

        def export(rid, head_range, tok):
            return mine_kv[:, :, tok[0] : tok[1], head_range[0] - rank * 4 : head_range[1] - rank * 4]

        with _Peak() as peak:
            out_kv = gather_kv(kv_plan, rank, export, transport, num_layers=layers, head_dim=hd, dtype=torch.float32,
                               device="cpu", pin_memory=DEVICE == "cuda", chunk_bytes=CHUNK)
        # on the GPU the result lives in host memory (not in the CUDA statistics); on the CPU check, leave it out
        result = 0 if DEVICE == "cuda" else sum(t.numel() * t.element_size() for t in out_kv.values())
        report["kv_peak"] = peak.peak - result
        report["kv_token_bytes"] = layers * 2 * heads * hd * 4
        report["kv_exact"] = bool(torch.equal(out_kv[f"r{rank}"], kv))
        dist.barrier()
    finally:
        Path(f"{out}.{rank}").write_text(json.dumps(report))
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_staged_transport_in_place_shrink_and_bounded_kv_on_one_gpu(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "report")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in (0, 1):
        rep = json.loads(Path(f"{out}.{rank}").read_text())
        assert rep["staged"] == (DEVICE == "cuda") and rep["round_trip"], rep
        if DEVICE == "cuda":
            assert rep["refused"], rep
        assert rep["reshard_exact"] and rep["reshard_in_place"], rep
        assert rep["reshard_peak"] <= CHUNK + SLACK, rep
        assert rep["tp1_shard_bytes"] > 20 * (CHUNK + SLACK), rep
        assert rep["kv_exact"], rep
        assert rep["kv_peak"] <= 2 * CHUNK + rep["kv_token_bytes"] + SLACK, rep
