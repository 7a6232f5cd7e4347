"""Continuous batching, batch limits and KV-capacity preemption never change outputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ref_helpers import make_engine, make_requests

LENGTHS, MAX_NEW = [2, 11, 5, 19, 8, 13], [9, 12, 15, 6, 11, 10]


def _by_id(outputs):
    return {o.request_id: (o.token_ids, o.log_probs, o.finish_reason) for o in outputs}


def _assert_same(got, expected):
    assert sorted(got) == sorted(expected)
    for rid, (tokens, log_probs, reason) in expected.items():
        assert got[rid][0] == tokens, rid
        assert got[rid][1] == pytest.approx(log_probs, abs=1e-9), rid
        assert got[rid][2] == reason, rid


@pytest.fixture(scope="module")
def alone(tiny_models):
    """Each request run by itself on a fresh engine."""
    engine = make_engine(tiny_models["llama"])
    return {r.request_id: _by_id(engine.generate([r]))[r.request_id] for r in make_requests(LENGTHS, MAX_NEW)}


def test_requests_added_while_others_decode(tiny_models, alone):
    engine = make_engine(tiny_models["llama"], block_size=4)
    requests = make_requests(LENGTHS, MAX_NEW)
    finished = []
    engine.add_requests(requests[:2])
    finished += engine.step(3).finished
    engine.add_requests(requests[2:5])
    finished += engine.step(2).finished
    engine.add_requests(requests[5:])
    snap = engine.snapshot()
    assert snap.num_waiting == 1 and len(snap.running) == 5 and snap.block_size == 4
    while engine.has_unfinished():
        finished += engine.step(4).finished
    _assert_same(_by_id(finished), alone)
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block returned


@pytest.mark.parametrize("limits", [dict(max_num_seqs=2), dict(max_prefill_tokens=8), dict(num_kv_blocks=8)])
def test_limits_and_preemption_keep_outputs(tiny_models, alone, limits):
    # num_kv_blocks=8 x block_size 4 = 32 slots: each request fits alone, all together do not.
    engine = make_engine(tiny_models["llama"], block_size=4, **limits)
    engine.add_requests(make_requests(LENGTHS, MAX_NEW))
    finished, num_preempted = [], 0
    while engine.has_unfinished():
        result = engine.step(1)
        finished += result.finished
        num_preempted += result.extra["num_preempted"]
        assert len(engine.scheduler.running) <= limits.get("max_num_seqs", 64)
    _assert_same(_by_id(finished), alone)
    if "num_kv_blocks" in limits:
        assert num_preempted > 0


def test_oversized_request_rejected_others_unaffected(tiny_models, alone):
    engine = make_engine(tiny_models["llama"], block_size=4, num_kv_blocks=8)
    requests = make_requests(LENGTHS, MAX_NEW)
    engine.add_requests(requests[:3])
    engine.step(2)
    big = make_requests([30], [4], prefix="big")  # 33 cached tokens -> 9 blocks > 8
    with pytest.raises(ValueError, match=r"needs 9 KV blocks.*num_kv_blocks=8"):
        engine.add_requests(requests[3:] + big)  # all-or-nothing: none of these are queued
    engine.add_requests(requests[3:])
    finished = []
    while engine.has_unfinished():
        finished += engine.step(4).finished
    _assert_same(_by_id(finished), alone)


def test_stop_tokens_and_eos(tiny_models, alone):
    engine = make_engine(tiny_models["llama"])
    request = make_requests(LENGTHS, MAX_NEW)[1]
    tokens = alone[request.request_id][0]
    stop = replace(request, sampling=replace(request.sampling, stop_token_ids=(tokens[3],)))
    (out,) = engine.generate([stop])
    assert out.token_ids == tokens[: tokens.index(tokens[3]) + 1] and out.finish_reason == "stop"
    # An eos override equal to that token stops there too, unless ignore_eos.
    engine = make_engine(tiny_models["llama"], eos_token_ids=(tokens[3],))
    assert engine.generate([request])[0].token_ids == out.token_ids
    ignore = replace(request, sampling=replace(request.sampling, ignore_eos=True))
    assert engine.generate([ignore])[0].token_ids == tokens
