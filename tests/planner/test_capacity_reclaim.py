"""The reclaiming pool's room rule (planner.capacity "sglang-pool-reclaim"): base room + the weight bytes a layout
frees - granule rounding loss; without a loss the stock engine's room, which is what the simulator's reclaiming
variant runs PAT on."""

from __future__ import annotations

import pytest

from pat_rollout.planner.capacity import (
    MemorySpec,
    kv_room_bytes,
    layout_kv_tokens,
    reclaim_kv_tokens,
    reclaim_room_bytes,
    stock_kv_tokens,
    tokens_in_room,
)

H100_VERL = MemorySpec(hbm_bytes=80e9, mem_fraction=0.6, activation_reserve_bytes=2e9)
KW = dict(param_bytes=2 * 8_030_261_248, kv_bytes_per_token=2 * 32 * 8 * 128 * 2, num_kv_heads=8, tps=(1, 2, 4, 8))


def test_reclaim_room_without_loss_is_the_stock_room() -> None:
    assert reclaim_kv_tokens(H100_VERL, **KW) == stock_kv_tokens(H100_VERL, **KW) == layout_kv_tokens(
        "sglang-pool-reclaim", H100_VERL, **KW)
    assert reclaim_kv_tokens(H100_VERL, **KW)[8] == 2_685_085


def test_reclaim_room_less_the_rounding_loss() -> None:
    loss = {2: 42 << 20, 4: 31 << 20}  # what vmem.ReclaimPlan leaves for Llama-3.1-8B's storages (docs/kv_reclaim.md)
    got = reclaim_kv_tokens(H100_VERL, **KW, loss_bytes=loss)
    base = kv_room_bytes(H100_VERL, param_bytes=KW["param_bytes"], tp=1)
    for tp in (2, 4):
        room = base + KW["param_bytes"] / 1 - KW["param_bytes"] / tp - loss[tp]
        assert got[tp] == tokens_in_room(room, kv_bytes_per_token=KW["kv_bytes_per_token"], num_kv_heads=8, tp=tp)
        assert got[tp] < stock_kv_tokens(H100_VERL, **KW)[tp]
    assert got[1] == stock_kv_tokens(H100_VERL, **KW)[1] and got[8] == stock_kv_tokens(H100_VERL, **KW)[8]
    with pytest.raises(ValueError, match=r"loss_bytes=5.0 in \[0, freed_bytes\]"):
        reclaim_room_bytes(10.0, freed_bytes=4.0, loss_bytes=5.0)


def test_simulated_reclaiming_runs_on_this_rule() -> None:
    from pat_rollout.sim.compare import gpu_setup, pat_hardware

    hw, model = gpu_setup("h100", "llama31_8b", "central")
    shape = model.model
    rule = layout_kv_tokens("sglang-pool-reclaim", MemorySpec.from_dict(model.memory), param_bytes=shape.param_bytes,
                            kv_bytes_per_token=shape.kv_bytes_per_token(), num_kv_heads=shape.num_kv_heads,
                            tps=sorted(hw.kv_tokens))
    assert pat_hardware(hw, "reclaiming").kv_tokens == rule
