"""Rebalancing in the pure planner: which requests move, what it costs, and when decide() picks it."""

from __future__ import annotations

import pytest

from pat_rollout.planner import ClusterState, Move, Planner, PlannerConfig, ReqProgress, plan_moves, rebalance_cost
from pat_rollout.planner.cost import prefers_migration
from pat_rollout.planner.estimator import drain_s
from pat_rollout.profile.model import LatencyModel
from pat_rollout.sim.compare import gpu_setup
from pat_rollout.sim.policies import StaticPolicy, run_policy
from pat_rollout.sim.traces import Trace, TraceRecord

M = 16384
ESTIMATORS = pytest.mark.parametrize("estimator", ["drain", "lookahead"])


@pytest.fixture(scope="module")
def h100() -> LatencyModel:
    return LatencyModel.from_json("h100_llama31_8b")


def _req(rid: str, key: str, replica: int | None, g: int = 100) -> ReqProgress:
    return ReqProgress(request_id=rid, prompt_key=key, num_prompt_tokens=200, num_output_tokens=g, max_new_tokens=M,
                       replica=replica)


def _planner(model: LatencyModel, tps=(1,), can_rebalance: bool = True, **kw) -> Planner:
    kw = {"min_gain_s": 0.5, "min_gain_ratio": 0.0, "eval_every_steps": 1, "min_steps_between_switches": 10, **kw}
    p = Planner(model, PlannerConfig(candidate_tps=tps, **kw), can_rebalance=can_rebalance)
    for _ in range(8):
        p.observe_history("long", 12000)  # earlier iterations: these prompts run ~12k tokens
        p.observe_history("short", 300)
    return p


def _skewed(step: int = 0, num_devices: int = 2) -> ClusterState:
    """Dispatch put every long request on replica 0 and the short ones on replica 1."""
    reqs = [_req(f"L{i}", "long", 0) for i in range(4)] + [_req(f"S{i}", "short", 1) for i in range(4)]
    return ClusterState(step=step, num_devices=num_devices, tp=1, requests=tuple(reqs))


def test_plan_moves_moves_long_requests_off_the_loaded_replica_only() -> None:
    ids = [f"L{i}" for i in range(4)] + [f"S{i}" for i in range(4)]
    moves = plan_moves(ids, [0, 0, 0, 0, 1, 1, 1, 1], [100, 100, 100, 100, 1, 1, 1, 1], 2)
    # balance() alone would also swap short requests to even out the 1s; those moves are undone
    assert moves == (Move(request_id="L1", src=0, dst=1), Move(request_id="L3", src=0, dst=1))
    assert plan_moves(ids, [0, 1, 0, 1, 0, 1, 0, 1], [100, 100, 100, 100, 1, 1, 1, 1], 2) == ()


def test_plan_moves_balances_work_not_count() -> None:
    # replica 0: two long requests; replica 1: six short ones. By count replica 1 is the loaded one.
    ids = ["a", "b", "c", "d", "e", "f", "g", "h"]
    moves = plan_moves(ids, [0, 0, 1, 1, 1, 1, 1, 1], [500, 500, 10, 10, 10, 10, 10, 10], 2)
    # one long request moves to the replica with more requests; of the short ones that balance() would send
    # the other way, only one stays moved: undoing it would leave 560 > 1.05 * 530 on replica 1
    assert moves == (Move(request_id="b", src=0, dst=1), Move(request_id="g", src=1, dst=0))
    assert plan_moves(ids, [0, 0, 1, 1, 1, 1, 1, 1], [500, 500, 10, 10, 10, 10, 10, 10], 2, slack=0.1) == (
        Move(request_id="b", src=0, dst=1),)


def test_plan_moves_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"replicas=\[0, 2\] must lie in \[0, 2\)"):
        plan_moves(["a", "b"], [0, 2], [1, 1], 2)
    with pytest.raises(ValueError, match=r"request_ids \(2\), replicas \(1\) and loads \(2\)"):
        plan_moves(["a", "b"], [0], [1, 1], 2)
    with pytest.raises(ValueError, match="src=1 and dst=1 must be distinct"):
        Move(request_id="a", src=1, dst=1)


def test_rebalance_cost_uses_the_shared_handoff_rule(h100: LatencyModel) -> None:
    moves = (Move(request_id="a", src=0, dst=1), Move(request_id="b", src=0, dst=1),
             Move(request_id="c", src=0, dst=2))
    tokens = {"a": 4000, "b": 2000, "c": 3000}
    cost = rebalance_cost(h100, tp=2, moves=moves, num_tokens=tokens)
    kvpt = h100.model.kv_bytes_per_token()
    assert all(prefers_migration(h100, 2, n) for n in tokens.values())  # H100: NVLink beats prefill
    # replica 1 receives a and b on its 2 devices in parallel: the slowest destination sets the pause
    assert cost.kv_s == pytest.approx(max(h100.kv_migrate_s(6000 * kvpt / 2), h100.kv_migrate_s(3000 * kvpt / 2)))
    assert (cost.num_migrated, cost.num_recomputed) == (3, 0)
    assert rebalance_cost(h100, tp=2, moves=(), num_tokens={}).total_s == 0.0


def test_decide_rebalances_a_skewed_assignment(h100: LatencyModel) -> None:
    p = _planner(h100)
    state = _skewed()
    d = p.decide(state)
    assert d is not None and d.is_rebalance and d.source_tp == d.target_tp == 1
    # two long requests move to the idle-ish replica, one short one (predicted 667 tokens) back to even it out
    assert d.moves == (Move(request_id="L1", src=0, dst=1), Move(request_id="L3", src=0, dst=1),
                       Move(request_id="S2", src=1, dst=0))
    # scored by the estimator on predicted (not true) lengths, with per-replica assignment
    pred = p.predict_remaining(state)
    rem = [pred[r.request_id] for r in state.requests]
    toks = [r.num_tokens for r in state.requests]
    now = drain_s(h100, tp=1, num_devices=2, remaining=rem, num_tokens=toks, replicas=[0] * 4 + [1] * 4)
    assert d.predicted_remaining_now_s == pytest.approx(now)
    dst = {m.request_id: m.dst for m in d.moves}
    after = [dst.get(r.request_id, r.replica) for r in state.requests]
    assert d.predicted_remaining_target_s == pytest.approx(
        drain_s(h100, tp=1, num_devices=2, remaining=rem, num_tokens=toks, replicas=after))
    assert d.predicted_saving_s > 0.5 and "moving 3" in d.reason
    assert p.rebalances == [0] and p.num_reconfigs == 0


def test_lookahead_rebalances_a_skewed_assignment(h100: LatencyModel) -> None:
    p = _planner(h100, estimator="lookahead")
    state = _skewed()
    d = p.decide(state)
    assert d is not None and d.is_rebalance and d.source_tp == d.target_tp == 1
    # two long requests move to the idle-ish replica; the short ones (drawn 200 tokens each) stay
    assert d.moves == (Move(request_id="L1", src=0, dst=1), Move(request_id="L3", src=0, dst=1))
    # scored by the lookahead on the predictor's draws (not true lengths), per replica, before and after the moves
    la = p.lookahead(state)
    assert la.remaining == {**{f"L{i}": 11900 for i in range(4)}, **{f"S{i}": 200 for i in range(4)}}
    assert d.predicted_remaining_now_s == pytest.approx(la.stay_s(1))
    assert d.predicted_remaining_target_s == pytest.approx(la.rebalance_s(1, d.moves))
    assert d.predicted_saving_s > 0.5 and "moving 2" in d.reason
    assert p.rebalances == [0] and p.num_reconfigs == 0


@ESTIMATORS
def test_no_rebalance_when_balanced_unknown_or_unsupported(h100: LatencyModel, estimator: str) -> None:
    balanced = ClusterState(step=0, num_devices=2, tp=1, requests=tuple(
        _req(f"L{i}", "long", i % 2) for i in range(4)))
    assert _planner(h100, estimator=estimator).decide(balanced) is None
    unknown = ClusterState(step=0, num_devices=2, tp=1, requests=tuple(_req(f"L{i}", "long", None) for i in range(4)))
    assert _planner(h100, estimator=estimator).decide(unknown) is None
    assert _planner(h100, estimator=estimator, can_rebalance=False).decide(_skewed()) is None  # e.g. the SGLang pool
    assert _planner(h100, estimator=estimator, rebalance=False).decide(_skewed()) is None


@ESTIMATORS
def test_no_rebalance_when_overhead_exceeds_benefit(h100: LatencyModel, estimator: str) -> None:
    d = h100.to_dict()
    d["kv_transfer"]["latency_s"] = 1e4  # migration is hopeless ...
    for p in d["prefill"]:
        p["fixed_s"] = 1e4  # ... and so is recomputation
    planner = _planner(LatencyModel.from_dict(d), estimator=estimator)
    assert planner.decide(_skewed()) is None
    assert planner.last_rebalance is not None and planner.last_rebalance.cost.total_s > 1e4
    assert planner.rebalances == []


@ESTIMATORS
def test_rebalance_hysteresis(h100: LatencyModel, estimator: str) -> None:
    p = _planner(h100, estimator=estimator, max_rebalances_per_stage=1)
    d = p.decide(_skewed(step=0))
    assert d is not None and d.is_rebalance
    assert p.decide(_skewed(step=100)) is None  # cap reached (the state is still skewed: the driver did not apply)
    p.cancel(d)  # rolled back: it does not count
    assert p.rebalances == []
    p2 = _planner(h100, estimator=estimator, min_steps_between_switches=50)
    assert p2.decide(_skewed(step=0)) is not None
    assert p2.decide(_skewed(step=20)) is None  # too soon after the last action
    assert p2.decide(_skewed(step=60)) is not None
    p2.start_stage()
    assert p2.rebalances == []


@ESTIMATORS
def test_decide_takes_the_cheaper_of_rebalance_and_regroup(h100: LatencyModel, estimator: str) -> None:
    """Four long requests on one TP1 replica of 8 devices: spreading them over TP1 replicas (a rebalance) is
    slower than one TP8 group for all four, as the simulator's truth has it for such a batch; the planner
    regroups to TP8 and scores the rebalance above it."""
    hw, _ = gpu_setup("h100", "llama31_8b", "central")
    trace = Trace(name="4", records=tuple(TraceRecord(prompt_id="long", prompt_len=200, response_len=12000)
                                          for _ in range(4)), max_new_tokens=M)
    sim = {tp: run_policy(hw, trace, StaticPolicy(tp), num_devices=8).latency_s for tp in (1, 2, 4, 8)}
    assert min(sim, key=sim.get) == 8
    reqs = tuple(_req(f"L{i}", "long", 0, g=2000) for i in range(4))
    state = ClusterState(step=3000, num_devices=8, tp=1, requests=reqs)
    p = _planner(h100, estimator=estimator, tps=(1, 2, 4, 8))
    d = p.decide(state)
    assert d is not None and not d.is_rebalance and d.target_tp == 8
    best = min((o for o in p.last_options if o.allowed), key=lambda o: o.total_s)
    assert best.tp == 8 and p.last_rebalance is not None and best.total_s < p.last_rebalance.total_s
    # without the rebalance option the planner regroups the same way
    d2 = _planner(h100, estimator=estimator, tps=(1, 2, 4, 8), can_rebalance=False).decide(state)
    assert d2 is not None and not d2.is_rebalance and d2.target_tp == 8


def test_decision_validates_action() -> None:
    from pat_rollout.planner import Decision

    kw = dict(step=0, source_tp=1, target_tp=1, predicted_remaining_now_s=1.0, predicted_remaining_target_s=0.5,
              predicted_overhead_s=0.1, reason="")
    with pytest.raises(ValueError, match="a rebalance has moves"):
        Decision(**kw, action="rebalance")
    with pytest.raises(ValueError, match="must be 'regroup' or 'rebalance'"):
        Decision(**kw, action="jump")
    assert Decision(**{**kw, "target_tp": 2}).action == "regroup"
