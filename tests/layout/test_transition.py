"""Property sweeps of plan_layout / plan_weights (pure: no torch needed)."""

from __future__ import annotations

import pytest
from transition_cases import CHAINS, MODELS, specs_for, transitions

from pat_rollout.layout import Layout, ShardSpec, plan_layout, plan_weights, shard_intervals
from pat_rollout.layout.transition import PlanCache, bytes_moved, spec_hash

CASES = transitions()


def _indices(spec: ShardSpec, rank: int, tp: int) -> list[int]:
    """Full-tensor indices of the sharded dim in local storage order."""
    return [i for lo, hi in shard_intervals(spec, rank, tp) for i in range(lo, hi)]


def _row(spec: ShardSpec) -> int:
    n = 1
    for i, s in enumerate(spec.shape):
        if i != spec.dim:
            n *= s
    return n


def _minimal_elements(src: Layout, dst: Layout, specs: dict[str, ShardSpec]) -> int:
    """Independent expectation: per device, elements of its new shard it does not already hold."""
    total = 0
    for device in src.devices:
        for spec in specs.values():
            if spec.dim is None:
                continue
            held = set(_indices(spec, src.position(device)[1], src.tp_size))
            need = set(_indices(spec, dst.position(device)[1], dst.tp_size))
            total += len(need - held) * _row(spec)
    return total


def test_grow_and_shrink_rank_order() -> None:
    assert plan_layout(Layout.uniform(4, 1), 2) == Layout(((0, 1), (2, 3)))
    assert plan_layout(Layout.uniform(8, 2), 4) == Layout(((0, 2, 1, 3), (4, 6, 5, 7)))
    assert plan_layout(Layout(((0, 2, 1, 3), (4, 6, 5, 7))), 8) == Layout(((0, 4, 2, 6, 1, 5, 3, 7),))
    # Shrink undoes grow exactly: old rank r -> group r % k, rank r // k.
    assert plan_layout(Layout(((0, 4, 2, 6, 1, 5, 3, 7),)), 4) == Layout(((0, 2, 1, 3), (4, 6, 5, 7)))
    assert plan_layout(Layout(((0, 2, 1, 3), (4, 6, 5, 7))), 2) == Layout.uniform(8, 2)
    assert plan_layout(Layout.uniform(3, 3), 3) == Layout.uniform(3, 3)


def test_invalid_transitions_raise_with_operands() -> None:
    with pytest.raises(ValueError, match="dst_tp=3 .*num_devices=4"):
        plan_layout(Layout.uniform(4, 2), 3)
    specs = specs_for("llama_gqa2")  # 8 heads
    with pytest.raises(ValueError, match=r"tp_size=3 cannot shard .*num_units=\d+"):
        plan_weights(Layout.uniform(6, 1), plan_layout(Layout.uniform(6, 1), 3), specs)
    with pytest.raises(ValueError, match="different devices"):
        plan_weights(Layout.uniform(2, 1), Layout(((0, 2),)), specs)


@pytest.mark.parametrize("name,src,dst", CASES, ids=[f"{n}-{s}-{d}" for n, s, d in CASES])
def test_plan_properties(name: str, src: Layout, dst: Layout) -> None:
    specs = specs_for(name)
    plan = plan_weights(src, dst, specs)
    assert [t.task_id for t in plan.transfers] == list(range(len(plan.transfers)))
    assert plan == plan_weights(src, dst, dict(reversed(list(specs.items()))))  # deterministic, order-free
    for device in dst.devices:
        for spec in plan.specs:
            need = _indices(spec, dst.position(device)[1], dst.tp_size)
            got: list[int | None] = [None] * len(need)
            for t in plan.transfers:
                if t.dst_device != device or t.name != spec.name:
                    continue
                src_idx = _indices(spec, src.position(t.src_device)[1], src.tp_size)
                # The source really holds [lo, hi) at src_offset.
                assert src_idx[t.src_offset : t.src_offset + t.length] == list(range(t.lo, t.hi))
                for k in range(t.length):
                    assert got[t.dst_offset + k] is None, "dst element covered twice"
                    got[t.dst_offset + k] = t.lo + k
            assert got == need, f"{spec.name} on device {device} not covered exactly once"
    moved = bytes_moved(plan, dtype_bytes=2)
    assert moved == 2 * _minimal_elements(src, dst, specs)
    if dst.tp_size % src.tp_size == 0:
        assert moved == 0 and all(t.is_local for t in plan.transfers)
    if src.tp_size % dst.tp_size == 0:
        # Shrink: every receive stays inside the receiver's old replica.
        for t in plan.transfers:
            assert src.position(t.src_device)[0] == src.position(t.dst_device)[0]


@pytest.mark.parametrize("name,n,tps", CHAINS)
def test_chain_back_and_forth_restores_layout(name: str, n: int, tps: list[int]) -> None:
    history = [Layout.uniform(n, tps[0])]
    for tp in tps[1:]:
        history.append(plan_layout(history[-1], tp))
        a, b = (history[-3].tp_size, history[-2].tp_size) if len(history) >= 3 else (0, 0)
        if len(history) >= 3 and a == tp and (a % b == 0 or b % a == 0):
            assert history[-1] == history[-3], f"{history[-3]} -> {history[-2]} -> {history[-1]} should return"
    assert len(history) == len(tps)


def test_greedy_fallback_keeps_overlap() -> None:
    specs = specs_for("qwen3_kv6")
    src = Layout.uniform(6, 2)
    dst = plan_layout(src, 3)
    assert dst.tp_size == 3 and dst.num_replicas == 2
    naive = Layout.uniform(6, 3)
    assert bytes_moved(plan_weights(src, dst, specs), 2) < bytes_moved(plan_weights(src, naive, specs), 2)


def test_receives_spread_over_replicated_holders() -> None:
    # 1xTP8 -> 8xTP1 for MQA-like KV replicated on all 8: each device fetches missing rows from its own
    # old replica; loads spread over the 8 holders rather than piling onto rank 0.
    specs = specs_for("llama_gqa2")
    src = Layout.uniform(8, 8)
    plan = plan_weights(src, plan_layout(src, 1), specs)
    senders = {t.src_device for t in plan.transfers if not t.is_local}
    assert senders == set(range(8))


def test_plan_cache() -> None:
    specs = specs_for("llama_gqa2")
    cache = PlanCache(max_entries=2)
    a = cache.get(Layout.uniform(4, 1), Layout.uniform(4, 2), specs)
    assert cache.get(Layout.uniform(4, 1), Layout.uniform(4, 2), dict(specs)) is a
    assert (cache.hits, cache.misses) == (1, 1)
    assert spec_hash(specs) != spec_hash(specs_for("qwen3_gqa4"))
    cache.get(Layout.uniform(4, 2), Layout.uniform(4, 4), specs)
    cache.get(Layout.uniform(4, 4), Layout.uniform(4, 1), specs)
    assert cache.get(Layout.uniform(4, 1), Layout.uniform(4, 2), specs) is not a  # evicted (LRU, 2 entries)


def test_models_are_valid() -> None:
    for model, max_tp in MODELS.values():
        model.check_tp(max_tp)
