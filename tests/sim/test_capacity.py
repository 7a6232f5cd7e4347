from __future__ import annotations

import pytest

from pat_rollout.planner.capacity import MemorySpec, blocks_for, kv_room_bytes, replica_kv_tokens, tokens_in_room

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
