"""The README's first command, `make demo`, on a smaller batch: a fresh process with its own local Ray, four runs side
by side, identical greedy tokens across them, and each PAT run's reconfiguration count matching the layouts it
reports. Whether PAT switches on this small batch is the calibrated planner's call on measured CPU times (TP2 saves
about as much as the margin here), so it is not asserted: deterministic switching is tests/workers/
test_planner_driven.py's (calibration off)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.ray
def test_demo_runs_static_and_pat_side_by_side_with_identical_tokens(tmp_path):
    cmd = [sys.executable, "-m", "pat_rollout.demo", "--requests", "8", "--long", "1", "--short-len", "8",
           "--long-len", "96", "--repeats", "2", "--model-dir", str(tmp_path)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {m[1].strip(): (float(m[2]), int(m[3]), m[4]) for m in
            re.finditer(r"^((?:static|PAT)[^\n]*?)\s+([\d.]+)\s+[\d.]+-[\d.]+\s+[\d.]+\s+(\d+)\s+(True|False)$",
                        proc.stdout, re.M)}
    assert set(rows) == {"static 2xTP1", "static 1xTP2", "PAT, CPU profile", "PAT, H100 profile"}, proc.stdout
    assert all(same == "True" for _, _, same in rows.values()), proc.stdout
    assert rows["static 2xTP1"][1] == rows["static 1xTP2"][1] == 0
    for name in ("PAT, CPU profile", "PAT, H100 profile"):
        layouts = re.search(rf"^{re.escape(name)}: layouts (.*)$", proc.stdout, re.M)
        assert layouts, proc.stdout
        assert layouts[1].count(" -> ") == rows[name][1], (name, layouts[1], rows[name])
        assert layouts[1].startswith("2xTP1[[0],[1]]@0.00s"), layouts[1]  # every stage starts in the base layout


def _result(times, tokens):
    from pat_rollout.bench.side_by_side import RunResult
    from pat_rollout.types import RequestOutput

    outs = [RequestOutput(request_id=f"r{i}", prompt_token_ids=(1,), token_ids=tuple(t), log_probs=(),
                          finish_reason="length") for i, t in enumerate(tokens)]
    return RunResult(times, outs, {"pat/num_reconfigs": 1})


def test_table_reports_median_ratio_to_best_static_and_flags_different_tokens(capsys):
    from pat_rollout.bench.side_by_side import print_table

    same = {"static a": _result([2.0, 4.0, 3.0], [[5, 6]]), "static b": _result([1.0], [[5, 6]]),
            "PAT": _result([1.5, 1.6, 1.4], [[5, 6]])}
    assert same["static a"].seconds == 3.0
    assert print_table(same) is True
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("PAT"))
    assert row.split() == ["PAT", "1.50", "1.40-1.60", "1.500", "1", "True"]
    differs = {"static": _result([1.0], [[5, 6]]), "PAT": _result([1.0], [[5, 7]])}
    assert print_table(differs) is False
    repeat_differs = {"static": _result([1.0], [[5, 6]]), "PAT": _result([1.0], [[5, 6]])}
    repeat_differs["PAT"].same_each_repeat = False
    assert print_table(repeat_differs) is False
