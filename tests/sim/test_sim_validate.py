"""The validation benchmark's prediction side (no timing: measured values are placeholders)."""

from __future__ import annotations

import pytest

from pat_rollout.bench.sim_validate import CONFIGS, batch_specs
from pat_rollout.bench.sim_validate_report import report


def test_report_predicts_every_config_and_the_h100_planner_switches(capsys: pytest.CaptureFixture[str]) -> None:
    specs = batch_specs()
    assert [len(v) for v in specs.values()] == [16, 16, 24]
    assert max(n for _, n in specs["demo (16 req, 1 long 320)"]) == 320
    measured = {"meta": {"steps_per_poll": 4, "num_kv_blocks": 512, "batches": specs},
                "runs": {c: {b: [{"seconds": 10.0}] for b in specs} for c in CONFIGS}}
    errors = report(measured, ["cpu_ref_llama_demo"])
    out = capsys.readouterr().out
    assert len(errors) == len(CONFIGS) * len(specs)
    for cfg in ("PAT, CPU profile", "PAT, H100 profile"):
        layouts = [line.split("%  ")[1].split("  MISS")[0].split(" -> ") for line in out.splitlines() if cfg in line]
        assert len(layouts) == 3 and any(len(stage) > 1 for stage in layouts)  # the planner switches
        for prev, cur in zip(layouts, layouts[1:]):  # a stage starts in the layout the previous one ended in
            assert cur[0] == prev[-1].split("@")[0] + "@0.0s"
    assert all("->" not in line for line in out.splitlines() if "static" in line)
