"""gather_kv with LoopbackTransport: exact reassembly of unique-valued fake KV, one message per pair (in one round),
and with small chunks: still exact, peak scratch within the rounds' bound (AllocSpy)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pat_rollout.comm.alloc_spy import AllocSpy
from pat_rollout.comm.transport import LoopbackMailbox, LoopbackTransport
from pat_rollout.kv import KVMove, plan_kv
from pat_rollout.kv.apply import gather_kv
from pat_rollout.layout import Layout, kv_heads_for_rank, plan_layout

L, D = 3, 2


def fake_kv(request_idx: int, num_tokens: int, num_kv_heads: int) -> torch.Tensor:
    n = L * 2 * num_tokens * num_kv_heads * D
    return (torch.arange(n, dtype=torch.float32) + 100_000 * request_idx).reshape(L, 2, num_tokens, num_kv_heads, D)


def _uncounted_sends(transport) -> None:
    """The loopback's clone of each sent message is made outside the spy (gloo sends from the buffer itself)."""
    from torch.utils._python_dispatch import _disable_current_modes

    orig = transport.submit_send

    def submit_send(tensor, dst_device, task_id):
        with _disable_current_modes():
            orig(tensor, dst_device, task_id)

    transport.submit_send = submit_send


def run_gather(moves: list[KVMove], num_kv_heads: int, devices: tuple[int, ...], chunk_bytes: int = 64 << 20,
               spies: dict | None = None):
    plan = plan_kv(moves, num_kv_heads)
    full = {m.request_id: fake_kv(i, m.num_tokens, num_kv_heads) for i, m in enumerate(moves)}
    by_id = {m.request_id: m for m in moves}
    mailbox = LoopbackMailbox(timeout_s=20.0)

    def device_fn(device: int):
        def export(request_id: str, heads: tuple[int, int], tokens: tuple[int, int]) -> torch.Tensor:
            move = by_id[request_id]
            rank = move.src_group.index(device)  # raises if this device never held the request
            lo, hi = kv_heads_for_rank(num_kv_heads, rank, len(move.src_group))
            assert lo <= heads[0] and heads[1] <= hi, (device, request_id, heads)
            return full[request_id][:, :, tokens[0] : tokens[1], heads[0] : heads[1]].clone()

        transport = LoopbackTransport(mailbox, device)
        if spies is None:
            out = gather_kv(plan, device, export, transport, num_layers=L, head_dim=D, dtype=torch.float32,
                            chunk_bytes=chunk_bytes)
        else:
            _uncounted_sends(transport)
            with AllocSpy() as spy:
                out = gather_kv(plan, device, export, transport, num_layers=L, head_dim=D, dtype=torch.float32,
                                chunk_bytes=chunk_bytes)
            spies[device] = spy
        return out, transport.num_sent

    with ThreadPoolExecutor(len(devices)) as pool:
        results = dict(zip(devices, pool.map(device_fn, devices)))
    assert mailbox.pending() == []
    return plan, full, results


@pytest.mark.parametrize("n,tp_a,tp_b,num_kv_heads", [
    (2, 1, 2, 2), (2, 2, 1, 2), (4, 1, 4, 2), (4, 4, 1, 2), (8, 2, 4, 4), (8, 4, 8, 4), (8, 8, 2, 4),
    (8, 8, 1, 2), (8, 2, 8, 1), (6, 2, 3, 6), (6, 3, 2, 6), (6, 6, 1, 3),
])
def test_gather_exact(n: int, tp_a: int, tp_b: int, num_kv_heads: int) -> None:
    src = plan_layout(Layout.uniform(n, 1), tp_a)
    dst = plan_layout(src, tp_b)
    moves = []
    for i, g in enumerate(src.groups):
        for j, h in enumerate(dst.groups):
            if j == i % dst.num_replicas or set(g) & set(h):
                moves.append(KVMove(f"r{i}-{j}", g, h, 4 + i + j))
    plan, full, results = run_gather(moves, num_kv_heads, src.devices)
    for move in moves:
        for rank, device in enumerate(move.dst_group):
            lo, hi = kv_heads_for_rank(num_kv_heads, rank, len(move.dst_group))
            got = results[device][0][move.request_id]
            assert torch.equal(got, full[move.request_id][:, :, :, lo:hi])
    pairs = {(t.src_device, t.dst_device) for t in plan.transfers if not t.is_local}
    assert sum(s for _, s in results.values()) == len(pairs), "one message per (src, dst) pair"


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1000])
def test_gather_exact_in_small_chunks_and_bounded(chunk_bytes: int) -> None:
    """Many requests, rounds of at most `chunk_bytes`: every device still assembles exactly its heads, and what it
    allocates beyond the result (the received KV itself) stays within 2 chunks + one token's piece (a piece is one
    token at least: 2 x L x 2 x heads x D x 4 bytes per token)."""
    src = Layout.uniform(4, 1)
    dst = plan_layout(src, 4)
    moves = [KVMove(f"q{i}", src.groups[i % 4], dst.groups[0], 3 + 2 * i) for i in range(24)]
    spies: dict = {}
    plan, full, results = run_gather(moves, 4, src.devices, chunk_bytes=chunk_bytes, spies=spies)
    for move in moves:
        for rank, device in enumerate(move.dst_group):
            lo, hi = kv_heads_for_rank(4, rank, 4)
            assert torch.equal(results[device][0][move.request_id], full[move.request_id][:, :, :, lo:hi])
    token = L * 2 * 4 * D * 4  # every head of one token: the largest piece of one token
    for device, spy in spies.items():
        result = sum(t.numel() * 4 for t in results[device][0].values())
        assert spy.peak - result <= 2 * max(chunk_bytes, token) + token, (device, spy.peak, result)
