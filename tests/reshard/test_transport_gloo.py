"""Real multi-process run over torch.distributed gloo: weight grow + shrink and a KV gather via GlooTransport."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reshard_sim import full_weights, local_shards
from transition_cases import specs_for

from pat_rollout.comm.transport import GlooTransport
from pat_rollout.kv import KVMove, plan_kv
from pat_rollout.kv.apply import gather_kv
from pat_rollout.layout import Layout, kv_heads_for_rank, plan_layout, plan_weights
from pat_rollout.reshard.apply import reshard_local, shard

L, D, NUM_KV_HEADS = 2, 2, 4


def _fake_kv(i: int, num_tokens: int) -> torch.Tensor:
    n = L * 2 * num_tokens * NUM_KV_HEADS * D
    return (torch.arange(n, dtype=torch.float32) + 10_000 * i).reshape(L, 2, num_tokens, NUM_KV_HEADS, D)


def _check_kv(moves: list[KVMove], rank: int, transport: GlooTransport) -> None:
    plan = plan_kv(moves, NUM_KV_HEADS)
    full = {m.request_id: _fake_kv(i, m.num_tokens) for i, m in enumerate(moves)}

    def export(request_id: str, heads: tuple[int, int], tokens: tuple[int, int]) -> torch.Tensor:
        return full[request_id][:, :, tokens[0] : tokens[1], heads[0] : heads[1]].clone()

    got = gather_kv(plan, rank, export, transport, num_layers=L, head_dim=D, dtype=torch.float32, chunk_bytes=200)
    for m in moves:
        if rank in m.dst_group:
            lo, hi = kv_heads_for_rank(NUM_KV_HEADS, m.dst_group.index(rank), len(m.dst_group))
            assert torch.equal(got[m.request_id], full[m.request_id][:, :, :, lo:hi]), (rank, m)


def _worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        transport = GlooTransport(None)  # identity device -> rank map
        specs = specs_for("qwen3_gqa4")
        full = full_weights(specs)
        layout = Layout.uniform(world, 1)
        shards = local_shards(full, specs, layout, rank)
        tps = [world, 1] if world == 2 else [2, world, 2, 1]
        for tp in tps:  # grow and shrink
            dst = plan_layout(layout, tp)
            shards = reshard_local(shards, plan_weights(layout, dst, specs), rank, transport)
            for name, spec in specs.items():
                assert torch.equal(shards[name], shard(full[name], spec, dst.position(rank)[1], tp)), (rank, tp, name)
            layout = dst
        grown = plan_layout(layout, world)
        # KV: every TP1 replica's request joins the grown group, then the grown group's requests split back.
        _check_kv([KVMove(f"in{d}", (d,), grown.groups[0], 3 + d) for d in range(world)], rank, transport)
        _check_kv([KVMove(f"out{d}", grown.groups[0], (d,), 5 + d) for d in range(world)], rank, transport)
        dist.barrier()
    finally:
        transport.close()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reshard_and_kv(world: int, tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)
