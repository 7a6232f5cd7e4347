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
    rows = [line for line in out.splitlines() if "PAT, H100 profile" in line]
    assert len(rows) == 3 and all("TP1@0.0s -> TP2@" in r for r in rows)  # that profile makes the planner grow
    assert all("->" not in line for line in out.splitlines() if "static" in line)
