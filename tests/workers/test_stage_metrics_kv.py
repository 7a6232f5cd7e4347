"""Stage metrics of the KV capacity per replica (`Pool.kv_tokens`), as the driver records it at each layout."""

from __future__ import annotations

from pat_rollout.driver.metrics import StageMetrics
from pat_rollout.driver.pool import ReconfigResult
from pat_rollout.layout import Layout


def test_kv_tokens_per_layout_in_stage_metrics() -> None:
    m = StageMetrics()
    m.record_layout("2xTP1")  # a pool that does not report its capacity (RefPool): no kv keys
    assert not any(k.startswith("pat/kv_tokens") for k in m.as_dict())
    m = StageMetrics()
    m.record_layout("2xTP1", 300)
    m.record_reconfig(ReconfigResult(src=Layout.uniform(2, 1), dst=Layout.uniform(2, 2)), "1xTP2", 601)
    d = m.as_dict()
    assert d["pat/kv_tokens_per_replica"] == 601  # the layout the stage ended in
    assert d["pat/kv_tokens_layouts"] == "2xTP1:300 -> 1xTP2:601"
    m.record_layout("2xTP1", 300)  # a failed switch's rollback records the base layout again
    assert m.as_dict()["pat/kv_tokens_per_replica"] == 300
