"""The uniform oracle with rebalances (issue #26's fair baseline) and the mixed oracle seeded from it."""

from __future__ import annotations

import json

import pytest

from pat_rollout.kv.cost import HandoffCost
from pat_rollout.planner.rebalance import Move
from pat_rollout.sim import DriverModel, ReconfigModel, SchedulerModel, Sim, SimHardware, Trace, TraceRecord
from pat_rollout.sim.buddy import Batch, Merge, MixedSim
from pat_rollout.sim.mixed_oracle import MixedSchedulePolicy, mixed_oracle
from pat_rollout.sim.policies import REBALANCE, StaticPolicy, SwitchPolicy, oracle_search, schedule_actions
from pat_rollout.sim.simulator import HindsightRebalance, Rebalance, Reconfigure


class BatchBound:
    """Step model where the batch dominates a step and TP scales poorly: long requests sharing a replica slow
    each other, so spreading them (a rebalance) beats any whole-pool switch."""

    def decode_step_s(self, tp: int, batch: float, context: float) -> float:
        return (0.1 + 0.2 * batch) / tp ** 0.3 if batch > 0 else 0.0

    def prefill_s(self, tp: int, num_tokens: int) -> float:
        return 0.001 * num_tokens if num_tokens > 0 else 0.0


def _hw() -> SimHardware:
    return SimHardware(name="test", step=BatchBound(), param_bytes=4000, kv_bytes_per_token=10,
                       kv_tokens={1: 4000, 2: 9000, 4: 20000}, scheduler=SchedulerModel(kind="sglang", block_size=1),
                       driver=DriverModel(lockstep=False, poll_interval_s=1.0),
                       reconfig=ReconfigModel(fixed_s=0.5, reshard_bytes_per_s=1000.0, kv_bytes_per_s=1e4))


# least-inflight dispatch puts requests 0, 4 and 8 (the long ones) on replica 0 of 4xTP1
TRACE = Trace(name="t", records=tuple(TraceRecord(prompt_id=f"p{i}", prompt_len=20, response_len=n) for i, n in
                                      enumerate([300, 30, 40, 50, 280, 60, 35, 45, 260, 70, 80, 38])),
              max_new_tokens=400)
MIGRATE = HandoffCost(link_bytes_per_s=1e4, per_transfer_latency_s=0.0, prefill_tokens_per_s=((1, 10.0),))


def test_hindsight_rebalance_spreads_the_true_longest_at_a_rebalance_cost() -> None:
    sim = Sim(_hw(), TRACE, num_devices=4, policy=StaticPolicy(1))
    assert {sim.where[r] for r in ("r0", "r4", "r8")} == {0}
    sim.run(stop=lambda s: s.t >= 3.0)
    t0 = max(rep.t for rep in sim.replicas)
    sim.apply(HindsightRebalance())
    assert len({sim.where[r] for r in ("r0", "r4", "r8")}) == 3  # by true remaining tokens, nothing else known
    res = sim.result("x")
    assert res.num_rebalances == 1 and res.rebalance_s == pytest.approx(0.5) and sim.t == pytest.approx(t0 + 0.5)
    sim.apply(HindsightRebalance())  # balanced already: no move, no pause
    assert sim.result("x").num_rebalances == 1 and sim.t == pytest.approx(t0 + 0.5)


@pytest.mark.parametrize("ho", [None, MIGRATE], ids=["recompute", "migrate"])
def test_uniform_oracle_with_rebalances_beats_the_switch_only_one(ho: HandoffCost | None) -> None:
    only = oracle_search(_hw(), TRACE, num_devices=4, tps=(1, 2, 4), grid=8, handoff=ho)
    res, tp0, sched = oracle_search(_hw(), TRACE, num_devices=4, tps=(1, 2, 4), grid=8, handoff=ho, rebalance=True)
    assert only[0].policy == "oracle" and res.policy == "oracle-rebalance"
    assert REBALANCE not in {tp for _, tp in only[2]} and only[0].num_rebalances == 0
    assert res.latency_s < 0.9 * only[0].latency_s and res.num_rebalances >= 1
    assert 1 <= sum(tp == REBALANCE for _, tp in sched) <= 2  # max_rebalances
    # the schedule it reports is what it simulated: replayed by SwitchPolicy on Sim and on MixedSim
    replay = Sim(_hw(), TRACE, num_devices=4, policy=SwitchPolicy(tp0=tp0, switches=sched), handoff=ho).run()
    entries = tuple((c, schedule_actions([(c, tp)])[0]) for c, tp in sched)
    mixed = MixedSim(_hw(), TRACE, num_devices=4, policy=MixedSchedulePolicy(tp0=tp0, entries=entries), handoff=ho)
    assert replay.result("x").latency_s == mixed.run().result("x").latency_s == res.latency_s


def test_switch_policy_runs_entries_due_together_in_order() -> None:
    view = Sim(_hw(), TRACE, num_devices=4, policy=StaticPolicy(1)).run(stop=lambda s: True).view()
    pol = SwitchPolicy(tp0=1, switches=((99, 2), (99, REBALANCE), (99, 4), (99, 2), (1, REBALANCE)))
    assert pol.on_poll(view) == Batch(actions=(Reconfigure(tp=2), HindsightRebalance(), Reconfigure(tp=2)))
    assert SwitchPolicy(tp0=1, switches=((99, 2), (99, 1))).on_poll(view) is None  # back where it is: a stay


def test_mixed_oracle_is_seeded_by_the_uniform_oracle_with_rebalances() -> None:
    uni = oracle_search(_hw(), TRACE, num_devices=4, tps=(1, 2, 4), grid=8, rebalance=True)
    assert mixed_oracle(_hw(), TRACE, num_devices=4, tps=(1, 2, 4), grid=8, passes=0).latency_s \
        == uni[0].latency_s  # computed with rebalances when not given
    res = mixed_oracle(_hw(), TRACE, num_devices=4, tps=(1, 2, 4), grid=8, passes=1, beam=1, uniform=uni)
    assert res.policy == "mixed-oracle" and res.latency_s <= uni[0].latency_s


def test_rebalances_run_on_uniform_layouts_only() -> None:
    sim = MixedSim(_hw(), TRACE, num_devices=4, policy=StaticPolicy(1))
    sim.run(stop=lambda s: s.t >= 3.0)
    assert sim.applies(HindsightRebalance())
    sim.apply(Merge(start=0, size=1))
    assert sim.sizes() == (2, 1, 1) and not sim.applies(HindsightRebalance())
    with pytest.raises(ValueError, match="uniform layouts only"):
        sim.apply(Rebalance(moves=(Move(request_id="r1", src=1, dst=2),)))
    sim.apply(Batch(actions=(HindsightRebalance(),)))  # skipped: the mixed layout cannot rebalance
    assert sim.result("x").num_rebalances == 0


def test_decision_table_applies_the_issue_rule_and_lists_missing_rows(tmp_path) -> None:
    from pat_rollout.bench.mixed_vs_uniform import decision, load, table

    assert decision([1.0, 0.99, 0.951]).endswith("do not build (below the 2% median / 5% row bar)")
    assert decision([1.0, 1.0, 0.95]).endswith("build mixed layouts for real")  # one row at 5%
    assert decision([0.98, 0.97, 1.0]).endswith("build mixed layouts for real")  # 2% at the median
    order = [("m", "g", v, "t") for v in ("low", "high")]
    row = {"model": "m", "gpu": "g", "variant": "low", "trace": "t", "uniform_s": 100.0, "mixed_s": 97.0,
           "ratio": 0.97, "uniform_rebalances": 1, "mixed_layouts": "4+2+2@0.0s"}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({**row, "ratio": 0.5}) + "\n" + json.dumps(row) + "\n")  # the last line of a row wins
    out = table(load([str(path)]), order)
    assert "low: 1 rows, median 0.970, best 0.970 -> build" in out and "all 1 of 2 rows" in out
    assert out.endswith("missing: m/g/high/t")


def test_run_skips_rows_in_out_and_in_done_files(tmp_path, monkeypatch) -> None:
    from pat_rollout.bench import mixed_vs_uniform as mvu

    ran = []

    def fake_row(model, gpu, variant, trace, **_):
        ran.append((model, gpu, variant, trace))
        return {"model": model, "gpu": gpu, "variant": variant, "trace": trace}

    monkeypatch.setattr(mvu, "run_row", fake_row)
    order = mvu.rows("llama31_8b", "h100", "low", "")
    assert len(order) >= 3
    done, out = tmp_path / "done.jsonl", tmp_path / "out.jsonl"
    done.write_text(json.dumps(dict(zip(("model", "gpu", "variant", "trace"), order[0]))) + "\n")
    out.write_text(json.dumps(dict(zip(("model", "gpu", "variant", "trace"), order[1]))) + "\n")
    mvu.main(["--models", "llama31_8b", "--gpus", "h100", "--variants", "low", "--out", str(out), "--done", str(done)])
    assert ran == order[2:]
    assert [mvu.key(r) for r in mvu.load([str(out)])] == order[1:]  # finished rows appended; done file untouched
    assert len(done.read_text().splitlines()) == 1
