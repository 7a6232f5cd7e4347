"""PatRolloutConfig.reclaim_weight_memory: SGLang only, base layout the smallest TP, off by default."""

from __future__ import annotations

import pytest

from pat_rollout.config import PatRolloutConfig


def test_reclaim_flag_checks():
    assert PatRolloutConfig(model_path="m", num_devices=2).reclaim_weight_memory is False
    ok = PatRolloutConfig(model_path="m", num_devices=4, backend="sglang", initial_tp=1, candidate_tps=(1, 2, 4),
                          reclaim_weight_memory=True)
    assert ok.reclaim_weight_memory
    with pytest.raises(ValueError, match=r"needs backend='sglang' \(got 'reference'\)"):
        PatRolloutConfig(model_path="m", num_devices=2, reclaim_weight_memory=True)
    with pytest.raises(ValueError, match=r"initial_tp=2, TP sizes \(1, 2\)"):
        PatRolloutConfig(model_path="m", num_devices=2, backend="sglang", initial_tp=2, candidate_tps=(1, 2),
                         reclaim_weight_memory=True)
