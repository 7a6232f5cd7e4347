"""The pure layer (planner, sim, profile model, layout) must import without torch, ray or sglang."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["pat_rollout.planner", "pat_rollout.sim", "pat_rollout.profile.model",
                                    "pat_rollout.profile", "pat_rollout.layout",
                                    "pat_rollout.planner.capacity", "pat_rollout.planner.config",
                                    "pat_rollout.planner.engine_model", "pat_rollout.planner.lookahead",
                                    "pat_rollout.planner.mixed",
                                    "pat_rollout.profile.published",
                                    "pat_rollout.sim.compare", "pat_rollout.sim.lengths",
                                    "pat_rollout.bench.sim_validate_report"])
def test_pure_modules_import_no_heavy_deps(module: str) -> None:
    code = (f"import sys, {module}\n"
            "bad = sorted({'torch', 'ray', 'sglang'} & set(sys.modules))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"importing {module} pulled in heavy modules:\n{res.stderr}"
