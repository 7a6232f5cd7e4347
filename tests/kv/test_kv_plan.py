"""Property sweep of plan_kv (pure) and unit tests of the hand-off cost model."""

from __future__ import annotations

import itertools

import pytest

from pat_rollout.kv import HandoffCost, HandoffMethod, KVMove, choose_handoff, plan_kv
from pat_rollout.layout import Layout, kv_heads_for_rank, plan_layout


def _moves_for(src: Layout, dst: Layout, tokens: int = 5) -> list[KVMove]:
    """Every old replica sends one request to every new replica that shares a device with it (and to the
    first new replica), mirroring where the driver would place survivors."""
    moves = []
    for i, g in enumerate(src.groups):
        targets = {j for j, h in enumerate(dst.groups) if set(g) & set(h)} | {0}
        for j in sorted(targets):
            moves.append(KVMove(f"r{i}-{j}", g, dst.groups[j], tokens + i))
    return moves


def _cases() -> list[tuple[int, Layout, Layout]]:
    out = []
    for n in range(1, 9):
        for tp_a, tp_b in itertools.product([t for t in range(1, n + 1) if n % t == 0], repeat=2):
            for h in (1, 2, 4, 8, 3, 6):
                ok = all(h % t == 0 or t % h == 0 for t in (tp_a, tp_b))
                if ok and tp_a != tp_b:
                    src = plan_layout(Layout.uniform(n, 1), tp_a)
                    out.append((h, src, plan_layout(src, tp_b)))
    return out


@pytest.mark.parametrize("num_kv_heads,src,dst", _cases())
def test_plan_kv_properties(num_kv_heads: int, src: Layout, dst: Layout) -> None:
    moves = _moves_for(src, dst)
    plan = plan_kv(moves, num_kv_heads)
    assert plan == plan_kv(moves, num_kv_heads)
    assert [t.task_id for t in plan.transfers] == list(range(len(plan.transfers)))
    for move in moves:
        src_tp, dst_tp = len(move.src_group), len(move.dst_group)
        held = {d: set(range(*kv_heads_for_rank(num_kv_heads, r, src_tp))) for r, d in enumerate(move.src_group)}
        for rank, device in enumerate(move.dst_group):
            need = list(range(*kv_heads_for_rank(num_kv_heads, rank, dst_tp)))
            mine = [t for t in plan.transfers if t.request_id == move.request_id and t.dst_device == device]
            got = [h for t in mine for h in range(*t.kv_heads)]
            assert got == need, "needed heads covered exactly once, in order"
            for t in mine:
                assert t.num_tokens == move.num_tokens
                assert set(range(*t.kv_heads)) <= held[t.src_device], "source holds what it sends"
                if set(range(*t.kv_heads)) & held.get(device, set()):
                    assert t.is_local, "heads already on the device are copied locally"


def test_grow_kv_local_first_and_replicated_spread() -> None:
    # Request on TP1 replica (0,) moving into TP2 group (0, 1) with 2 KV heads: head 0 stays on 0,
    # head 1 comes from 0.
    plan = plan_kv([("a", (0,), (0, 1), 7)], num_kv_heads=2)  # plain tuples are accepted too
    assert plan.moves == (KVMove("a", (0,), (0, 1), 7),)
    assert [(t.src_device, t.dst_device, t.kv_heads) for t in plan.transfers] == [(0, 0, (0, 1)), (0, 1, (1, 2))]
    # 1 KV head replicated on 4 ranks, shrinking to TP1 on 4 replicas: each device copies locally.
    plan = plan_kv([KVMove(f"q{d}", (0, 1, 2, 3), (d,), 3) for d in range(4)], num_kv_heads=1)
    assert all(t.is_local for t in plan.transfers)
    # Replicated heads fetched by outsiders spread over holders: 4 requests from (0,1,2,3) (1 head) to (4,).
    plan = plan_kv([KVMove(f"q{i}", (0, 1, 2, 3), (4,), 3) for i in range(4)], num_kv_heads=1)
    assert sorted(t.src_device for t in plan.transfers) == [0, 1, 2, 3]


def test_plan_kv_rejects_bad_groups() -> None:
    with pytest.raises(ValueError, match="group size 3 and num_kv_heads=2"):
        plan_kv([KVMove("a", (0, 1, 2), (0,), 1)], num_kv_heads=2)


COST = HandoffCost(link_bytes_per_s=10e9, per_transfer_latency_s=1e-3,
                   prefill_tokens_per_s=((1, 10_000.0), (2, 18_000.0)), prefill_latency_s=0.01)


def test_choose_handoff_pins_both_ways() -> None:
    # Long context, small KV per token: migrate 1e-3 + 8000 * 1e5 / 1e10 = 0.081 s vs recompute
    # 0.01 + 8000 / 18000 = 0.454 s.
    d = COST.choose_handoff(8000, 100_000, 2)
    assert d.method is HandoffMethod.MIGRATE and d.method == "migrate" and not d.forced
    assert d.migrate_s == pytest.approx(0.081) and d.recompute_s == pytest.approx(0.01 + 8000 / 18000)
    # Short context, huge KV per token over a slow link: migrate 1e-3 + 16 * 1e9 / 1e10 = 1.601 s vs
    # recompute 0.01 + 16 / 10000 = 0.0116 s.
    d = choose_handoff(16, 1_000_000_000, 1, cost=COST)
    assert d.method is HandoffMethod.RECOMPUTE and d.method.is_recompute
    assert d.migrate_s == pytest.approx(1.601) and d.recompute_s == pytest.approx(0.0116)
    forced = COST.choose_handoff(16, 1_000_000_000, 1, mode="migrate")
    assert forced.method.is_migrate and forced.forced and forced.migrate_s == d.migrate_s
    assert COST.choose_handoff(0, 100, 1).method is HandoffMethod.RECOMPUTE  # nothing cached: nothing to move


def test_prefill_rate_scaling_and_validation() -> None:
    assert COST.prefill_rate(2) == 18_000.0
    assert COST.prefill_rate(8) == 18_000.0 * 4  # linear from the nearest measured size below
    with pytest.raises(ValueError, match="mode='fast'"):
        COST.choose_handoff(1, 1, 1, mode="fast")
    with pytest.raises(ValueError, match="link_bytes_per_s=0"):
        HandoffCost(link_bytes_per_s=0, per_transfer_latency_s=0, prefill_tokens_per_s=((1, 1.0),))
