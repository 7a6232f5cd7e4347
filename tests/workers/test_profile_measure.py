"""The profiler (`python -m pat_rollout.profile`): its reshard fit from repeated reconfigurations, and a whole (tiny)
measurement on real Ray actors that the planner's LatencyModel loads."""

from __future__ import annotations

import pytest

from pat_rollout.config import DTYPE_BYTES
from pat_rollout.profile.measure import ProfileGrid, _fit_reshard
from pat_rollout.types import ModelSpec

SPEC = ModelSpec(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=256)


def test_reshard_fit_takes_medians_of_grows_and_of_the_first_shrinking_pair():
    phases = [(1, 2, {"reshard": 0.10, "kv_handoff": 0.02}), (2, 1, {"reshard": 0.52}), (1, 2, {"reshard": 0.30}),
              (2, 1, {"reshard": 2.50}), (1, 2, {"reshard": 0.20}), (2, 1, {"reshard": 0.72})]
    fit = _fit_reshard(phases, SPEC, "float32")
    assert fit["fixed_s"] == pytest.approx(0.20)  # median of 0.12, 0.30, 0.20
    moved = SPEC.num_params() * DTYPE_BYTES["float32"] / 2  # TP2 -> TP1: every device receives the half it lacks
    assert fit["bandwidth_bytes_per_s"] == pytest.approx(moved / (0.72 - 0.20))  # median shrink: the outlier is out


def test_reshard_fit_without_reconfigurations_is_free():
    assert _fit_reshard([], SPEC, "float32") == {"bandwidth_bytes_per_s": 1e9, "fixed_s": 0.0}


@pytest.mark.ray
@pytest.mark.slow
def test_tiny_profile_measured_on_two_actors_loads(ray_cluster, tiny_models):
    from pat_rollout.profile.measure import measure_profile
    from pat_rollout.profile.model import LatencyModel

    grid = ProfileGrid(tps=(1, 2), batches=(1, 2), contexts=(8, 16), steps=4, steps_per_call=2, repeats=2)
    profile = measure_profile(tiny_models["llama"], grid, num_devices=2, hardware="test CPU")
    assert sorted((p["tp"], p["batch"], p["context"]) for p in profile["decode"]) == sorted(
        (tp, b, c + grid.context_offset) for tp in (1, 2) for b in (1, 2) for c in (8, 16))
    assert all(p["step_s_range"][0] <= p["step_s"] <= p["step_s_range"][1] for p in profile["decode"])
    # one grow before TP2's grid, then `repeats` shrinks back to the base layout with a grow between them
    assert "(1, 2, " in profile["meta"]["notes"] and profile["meta"]["notes"].count("(2, 1, ") == grid.repeats
    model = LatencyModel.from_dict(profile)
    assert model.reshard_bandwidth > 0 and model.reshard_fixed_s >= 0 and model.group_switch_s >= 0
    assert model.decode_step_s(tp=2, batch=2, context=12) > 0
