from __future__ import annotations

import pytest

from pat_rollout.planner.capacity import (
    MemorySpec,
    block_pool_kv_tokens,
    blocks_for,
    kv_room_bytes,
    layout_kv_tokens,
    pool_kv_tokens,
    replica_kv_tokens,
    stock_kv_tokens,
    tokens_in_room,
)

H100_VERL = MemorySpec(hbm_bytes=80e9, mem_fraction=0.6, activation_reserve_bytes=2e9)
LLAMA_W = 2 * 8_030_261_248
LLAMA_KV = 2 * 32 * 8 * 128 * 2  # 131072 B = 128 KiB per token


def test_kv_room_is_fraction_minus_weights_per_tp_minus_reserve() -> None:
    assert kv_room_bytes(H100_VERL, param_bytes=LLAMA_W, tp=1) == 48e9 - 16_060_522_496 - 2e9
    assert kv_room_bytes(H100_VERL, param_bytes=LLAMA_W, tp=4) == 48e9 - 4_015_130_624 - 2e9


def test_replica_tokens_exact() -> None:
    kw = dict(param_bytes=LLAMA_W, kv_bytes_per_token=LLAMA_KV, num_kv_heads=8)
    assert replica_kv_tokens(H100_VERL, tp=1, **kw) == 29_939_477_504 // 131072 == 228_420
    # TP8: each device holds one of the 8 KV heads (16 KiB per token) and an eighth of the weights
    assert replica_kv_tokens(H100_VERL, tp=8, **kw) == (48e9 - 2_007_565_312 - 2e9) // 16384 == 2_685_085
    # TP16 > 8 KV heads: heads are replicated, a device still pays one head per token
    assert replica_kv_tokens(H100_VERL, tp=16, **kw) == (48e9 - LLAMA_W / 16 - 2e9) // 16384


def test_tokens_in_room_grows_with_tp_in_the_same_room() -> None:
    """The rule the SGLang pool applies to its fixed KV storage: TPk holds k times TP1's tokens (k <= KV heads)."""
    kw = dict(kv_bytes_per_token=LLAMA_KV, num_kv_heads=8)
    room = 1000 * LLAMA_KV  # 1000 tokens of all 8 heads
    assert [tokens_in_room(room, tp=tp, **kw) for tp in (1, 2, 4, 8, 16)] == [1000, 2000, 4000, 8000, 8000]
    assert tokens_in_room(room - 1, tp=1, **kw) == 999
    with pytest.raises(ValueError, match="tp=0"):
        tokens_in_room(room, tp=0, **kw)


def test_no_room_names_every_operand() -> None:
    small = MemorySpec(hbm_bytes=20e9, mem_fraction=0.6, activation_reserve_bytes=2e9)
    with pytest.raises(ValueError, match=r"no KV room at tp=1: mem_fraction 0.6 x hbm 2e\+10 B - weights 1.606e\+10"):
        replica_kv_tokens(small, param_bytes=LLAMA_W, kv_bytes_per_token=LLAMA_KV, num_kv_heads=8, tp=1)
    with pytest.raises(ValueError, match="mem_fraction=1.5"):
        MemorySpec(hbm_bytes=1.0, mem_fraction=1.5, activation_reserve_bytes=0.0)


def test_blocks_for() -> None:
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 33)] == [0, 1, 1, 2, 3]
    with pytest.raises(ValueError, match="block_size=0"):
        blocks_for(3, 0)


def test_room_per_layout_by_backend() -> None:
    """#37: a stock engine at TPk keeps weights / k per device; the SGLang pool re-views the KV storage of its TP1
    base (k x TP1's tokens); the reference pool holds its blocks at every TP."""
    kw = dict(param_bytes=LLAMA_W, kv_bytes_per_token=LLAMA_KV, num_kv_heads=8, tps=(1, 2, 4, 8))
    stock = stock_kv_tokens(H100_VERL, **kw)
    pool = pool_kv_tokens(H100_VERL, **kw)
    assert stock == layout_kv_tokens("stock", H100_VERL, **kw)
    assert pool == layout_kv_tokens("sglang-pool", H100_VERL, **kw)
    room1 = 48e9 - LLAMA_W - 2e9
    assert pool == {1: 228_420, 2: int(room1 // 65536), 4: int(room1 // 32768), 8: int(room1 // 16384)}
    assert pool[8] == 1_827_360 and stock[8] == 2_685_085 and pool[1] == stock[1]
    assert all(pool[tp] < stock[tp] for tp in (2, 4, 8))
    # a TP2-based pool keeps TP2's weights per device: its TP4 holds 2 x its TP2's tokens
    two = pool_kv_tokens(H100_VERL, **{**kw, "tps": (2, 4)})
    assert two == {2: stock[2], 4: int((48e9 - LLAMA_W / 2 - 2e9) // 32768)}
    assert block_pool_kv_tokens(num_kv_blocks=256, block_size=16, tps=(1, 2, 4)) == {1: 4096, 2: 4096, 4: 4096}
    with pytest.raises(ValueError, match="room='vllm'"):
        layout_kv_tokens("vllm", H100_VERL, **kw)
    small = MemorySpec(hbm_bytes=20e9, mem_fraction=0.6, activation_reserve_bytes=2e9)
    with pytest.raises(ValueError, match="no KV room at tp=1"):
        pool_kv_tokens(small, **kw)


def test_simulated_pool_room_and_the_runs_that_use_it() -> None:
    """The simulator's statics run on the stock engine's room, PAT (and the planner's view of the engine) on the
    pool's: with TP2 its only layout, PAT is static TP2 on the pool's room, slower than the stock TP2 where KV
    binds; `reclaiming` gives PAT the stock room back."""
    from pat_rollout.planner import PlannerConfig
    from pat_rollout.sim.compare import compare, engine_spec, gpu_setup, pat_hardware, room_line
    from pat_rollout.sim.policies import StaticPolicy, run_policy
    from pat_rollout.sim.traces import deepscaler_like

    hw, model = gpu_setup("h100", "llama31_8b", "central")
    assert hw.kv_tokens[1] == hw.pool().kv_tokens[1]
    assert [hw.pool().kv_tokens[tp] // hw.kv_tokens[1] for tp in (2, 4, 8)] == [2, 4, 8]
    assert hw.pool().kv_tokens[2] < hw.kv_tokens[2] and pat_hardware(hw, "reclaiming").kv_tokens == hw.kv_tokens
    assert engine_spec(pat_hardware(hw)).kv_tokens == hw.pool().kv_tokens
    assert "PAT's pool (PAT, oracle): TP1 " in room_line(hw)
    trace = deepscaler_like(num_prompts=96, max_new_tokens=16384, seed=2)
    cfg = PlannerConfig(candidate_tps=(2,))
    cmp = compare(hw, model, trace, num_devices=8, planner_config=cfg, initial_tp=2, with_oracle=False)
    by = cmp.by()
    on_pool = run_policy(hw.pool(), trace, StaticPolicy(2), num_devices=8)
    assert by["pat"].latency_s == on_pool.latency_s and by["pat"].num_preempted == on_pool.num_preempted
    assert by["pat"].latency_s > by["static-tp2"].latency_s  # KV binds at TP2 on 96 x 8 long responses
    rec = compare(hw, model, trace, num_devices=8, planner_config=cfg, initial_tp=2, with_oracle=False,
                  room="reclaiming").by()
    assert rec["pat"].latency_s == by["static-tp2"].latency_s
