"""The hand-off's memory bound: `kv.cost.fit_to_cap` (pure) keeps a request for migration only while every device
receiving its KV stays within the cap; the rest are recomputed. `PatRolloutConfig.kv_handoff_cap` gives the cap."""

from __future__ import annotations

import pytest

from pat_rollout.config import PatRolloutConfig
from pat_rollout.kv.cost import fit_to_cap


def test_fit_to_cap_greedy_per_device():
    cands = [("a", (0, 1), 40), ("b", (0,), 50), ("c", (1,), 60), ("d", (0,), 10), ("e", (1,), 0)]
    keep, drop = fit_to_cap(cands, 100)
    # a: 0->40, 1->40; b: 0->90; c: 1 would be 100 ok -> 100; d: 0 would be 100 ok; e: 0 bytes fits
    assert keep == ["a", "b", "c", "d", "e"] and drop == []
    keep, drop = fit_to_cap(cands, 60)
    # a: 40/40; b: 0 would be 90 > 60 -> drop; c: 1 would be 100 -> drop; d: 0 -> 50; e fits
    assert keep == ["a", "d", "e"] and drop == ["b", "c"]
    assert fit_to_cap(cands, 0) == (["e"], ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="cap_bytes=-1"):
        fit_to_cap(cands, -1)


def test_config_cap_default_from_free_memory_and_validation():
    cfg = PatRolloutConfig(model_path="m", num_devices=4, kv_handoff_max_bytes=123)
    assert cfg.kv_handoff_cap() == 123
    default = PatRolloutConfig(model_path="m", num_devices=4).kv_handoff_cap()
    assert 0 < default < 2**50
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="kv_handoff_max_bytes"):
            PatRolloutConfig(model_path="m", num_devices=4, kv_handoff_max_bytes=bad)
    with pytest.raises(ValueError, match="transfer_chunk_bytes"):
        PatRolloutConfig(model_path="m", num_devices=4, transfer_chunk_bytes=0)
