"""The README's first command, `make demo`, on a smaller batch: a fresh process with its own local Ray, four runs side
by side, identical greedy tokens across them, and PAT (on the H100 profile) reconfiguring mid-decode."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_demo_runs_static_and_pat_side_by_side_with_identical_tokens(tmp_path):
    cmd = [sys.executable, "-m", "pat_rollout.demo", "--requests", "8", "--long", "1", "--short-len", "8",
           "--long-len", "96", "--model-dir", str(tmp_path)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m[1].strip(): (float(m[2]), int(m[3]), m[4]) for m in
            re.finditer(r"^((?:static|PAT)[^\n]*?)\s+([\d.]+)\s+[\d.]+\s+(\d+)\s+(True|False)$", proc.stdout, re.M)}
    assert set(rows) == {"static 2xTP1", "static 1xTP2", "PAT, CPU profile", "PAT, H100 profile"}, proc.stdout
    assert all(same == "True" for _, _, same in rows.values()), proc.stdout
    assert rows["static 2xTP1"][1] == rows["static 1xTP2"][1] == 0
    assert rows["PAT, H100 profile"][1] >= 1, proc.stdout  # that profile makes the planner switch on this batch
