"""The validation benchmark's prediction side (no timing: measured values are placeholders)."""

from __future__ import annotations

import re

import pytest
from profile_helpers import linear_profile

from pat_rollout.bench.sim_validate import CONFIGS, batch_specs
from pat_rollout.bench.sim_validate_report import report
from pat_rollout.sim.policies import ReplayPolicy, StaticPolicy, run_policy
from pat_rollout.sim.traces import Trace, TraceRecord

LAYOUTS = re.compile(r"  ((?:TP\d+@[\d.]+s(?: -> )?)+)(?:  MISS)?$")


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
        layouts = [LAYOUTS.search(line)[1].split(" -> ") for line in out.splitlines() if cfg in line]
        assert len(layouts) == 3 and any(len(stage) > 1 for stage in layouts)  # the planner switches
        for prev, cur in zip(layouts, layouts[1:]):  # a stage starts in the layout the previous one ended in
            assert cur[0] == prev[-1].split("@")[0] + "@0.0s"
    assert all("->" not in line for line in out.splitlines() if "static" in line)


def _hw():
    from pat_rollout.sim.hardware import ref_cpu_hardware

    return ref_cpu_hardware(linear_profile(), tps=(1, 2), num_kv_blocks=256, block_size=16, steps_per_poll=4)


def _trace() -> Trace:
    lengths = [200] + [12] * 7
    return Trace(name="t", records=tuple(TraceRecord(prompt_id=f"p{i}", prompt_len=8, response_len=n,
                                                     max_new_tokens=n) for i, n in enumerate(lengths)),
                 max_new_tokens=200)


class _Recording(ReplayPolicy):
    """The replayed layout as each poll leaves it."""

    def on_poll(self, view):
        action = ReplayPolicy.on_poll(self, view)
        self.seen.append(view.state.tp if action is None else action.tp)
        return action


def test_replay_switches_after_the_recorded_number_of_polls():
    pol = ReplayPolicy.from_layout_polls("1xTP2[[0,1]]@0 -> 2xTP1[[0],[1]]@0 -> 1xTP2[[0,1]]@5")
    assert pol.layouts == ((0, 2), (0, 1), (5, 2)) and pol.initial_tp() == 2
    rec = _Recording(layouts=pol.layouts)
    rec.seen = []
    res = run_policy(_hw(), _trace(), rec, num_devices=2, prev_tp=2)
    assert [tp for _, tp in res.schedule] == [2, 1, 2]
    assert res.schedule[1][0] == 0.0  # the stage-start switch, before any poll
    assert rec.seen[:6] == [1, 1, 1, 1, 2, 2]  # polls 1-4 in TP1, the 5th poll's decision regroups


def test_replay_of_one_layout_is_the_static_prediction():
    hw, trace = _hw(), _trace()
    for tp in (1, 2):
        replay = run_policy(hw, trace, ReplayPolicy.from_layout_polls(f"{2 // tp}xTP{tp}[[0]]@0"), num_devices=2,
                            prev_tp=tp)
        static = run_policy(hw, trace, StaticPolicy(tp), num_devices=2, prev_tp=tp)
        assert replay.latency_s == static.latency_s and replay.schedule == static.schedule


def test_replay_rejects_what_is_not_a_layout_trace():
    with pytest.raises(ValueError, match="'garbage' of 'garbage' is not a layout by poll"):
        ReplayPolicy.from_layout_polls("garbage")
    with pytest.raises(ValueError, match=r"'2xTP1\[\[0\],\[1\]\]@0.00s' of .* the driver's pat/layout_polls"):
        ReplayPolicy.from_layout_polls("2xTP1[[0],[1]]@0.00s -> 1xTP2[[0,1]]@0.31s")  # pat/layouts (seconds)
    with pytest.raises(ValueError, match="must start at poll 0"):
        ReplayPolicy(layouts=((3, 1),))
    with pytest.raises(ValueError, match="not in poll order"):
        ReplayPolicy(layouts=((0, 1), (9, 2), (4, 1)))


def test_report_replays_each_measured_runs_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    specs = batch_specs()
    polls = {"static 2xTP1": "2xTP1[[0],[1]]@0", "static 1xTP2": "1xTP2[[0,1]]@0",
             "PAT, CPU profile": "2xTP1[[0],[1]]@0 -> 1xTP2[[0,1]]@0",
             "PAT, H100 profile": "1xTP2[[0,1]]@0 -> 2xTP1[[0],[1]]@0 -> 1xTP2[[0,1]]@20"}
    measured = {"meta": {"steps_per_poll": 4, "num_kv_blocks": 512, "batches": specs},
                "runs": {c: {b: [{"seconds": 10.0, "layout_polls": polls[c]}] for b in specs} for c in CONFIGS}}
    report(measured, ["cpu_ref_llama_demo"])
    out = capsys.readouterr().out
    cols = re.compile(r" (\d+\.\d+) +([+-]\d+\.\d%) +(\d+\.\d+) +([+-]\d+\.\d%)  TP")
    rows = {(line[:30].strip(), line[31:49].strip()): cols.search(line) for line in out.splitlines()
            if line[:30].strip() in specs}
    assert len(rows) == len(specs) * len(CONFIGS) and all(rows.values()), out
    for b in specs:
        for c in ("static 2xTP1", "static 1xTP2"):
            m = rows[(b, c)]
            assert m[1] == m[3] and m[2] == m[4], m[0]  # a static run replayed is the static prediction
    assert "replaying each measured run's decisions" in out
