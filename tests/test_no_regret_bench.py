"""The no-regret benchmark's deliberately wrong profile and overhead sum (its timing runs are not tests)."""

from __future__ import annotations

import pytest

from pat_rollout.bench.no_regret import overhead_s, swapped_profile
from pat_rollout.profile.model import LatencyModel


def test_swapped_profile_exchanges_exactly_the_two_decode_grids() -> None:
    m = LatencyModel.from_json("cpu_ref_llama_demo")
    w = swapped_profile(m, 1, 2)
    for batch, ctx in ((1, 16), (4, 128), (16, 512)):
        assert w.decode_step_s(1, batch, ctx) == pytest.approx(m.decode_step_s(2, batch, ctx))
        assert w.decode_step_s(2, batch, ctx) == pytest.approx(m.decode_step_s(1, batch, ctx))
    assert w.prefill_s(1, 100) == m.prefill_s(1, 100) and w.reshard_bandwidth == m.reshard_bandwidth
    assert w.meta["notes"].startswith("DELIBERATELY WRONG")


def test_overhead_sums_every_reconfiguration_phase_only() -> None:
    metrics = {"pat/reconfig_reshard_s": 0.5, "pat/reconfig_switch_s": 0.25, "pat/num_reconfigs": 2,
               "pat/rebalance_export_s": 9.0, "pat/reconfig_layouts": 1}
    assert overhead_s(metrics) == pytest.approx(0.75)
