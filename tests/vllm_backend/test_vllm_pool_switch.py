"""VllmPool on real vLLM engines (tiny random Llama, CPU): 2 x TP1 and 1 x TP2 serve the HF greedy outputs, and a
mid-decode switch 2 x TP1 -> 1 x TP2 -> 2 x TP1 (recomputation) ends with the tokens of an unswitched run, token
for token, and log-probs close. One pool for the module (each engine start costs tens of seconds here)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from hf_reference import hf_greedy  # noqa: E402

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.layout import Layout  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow]

LOGPROB_ATOL = 1e-4
MAX_NEW = 24


@pytest.fixture(scope="module")
def pool(vllm_model):
    from pat_rollout.driver.backends import get_backend

    config = PatRolloutConfig(model_path=vllm_model, num_devices=2, backend="vllm", initial_tp=1,
                              candidate_tps=(1, 2), policy="manual", kv_handoff="recompute")
    backend = get_backend("vllm")
    p = backend.build_pool(config, backend.model_spec(config), Layout.uniform(2, 1), cost=None,
                           num_cpus_per_worker=1)
    yield p
    p.shutdown()


def _requests(tag: str) -> list[Request]:
    sp = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=tuple(range(3 + 5 * i, 10 + 7 * i)), sampling=sp)
            for i in range(4)]


def _split(reqs: list[Request], n: int) -> dict[int, list[Request]]:
    return {r: reqs[r::n] for r in range(n)}


def _run(pool, steps: int | None = None) -> dict[str, object]:
    """Step every busy replica until all finish (or `steps` rounds); the finished outputs by id."""
    done: dict[str, object] = {}
    rounds = 0
    while any(rep.busy() for rep in pool.replicas) and (steps is None or rounds < steps):
        busy = [r for r, rep in enumerate(pool.replicas) if rep.busy()]
        for res, _snap in pool.step(busy, 1).values():
            done.update({o.request_id: o for o in res.finished})
        rounds += 1
    return done


@pytest.fixture(scope="module")
def unswitched(pool, vllm_model):
    reqs = _requests("u")
    pool.add_requests(_split(reqs, 2))
    outs = _run(pool)
    return {rid[1:]: o for rid, o in outs.items()}


def test_2xtp1_equals_hf(pool, unswitched, vllm_model):
    reqs = _requests("u")
    assert sorted(unswitched) == [r.request_id[1:] for r in reqs]
    for r, (ids, lps) in zip(reqs, hf_greedy(vllm_model, reqs)):
        o = unswitched[r.request_id[1:]]
        assert list(o.token_ids) == ids, r.request_id
        assert o.log_probs == pytest.approx(lps, abs=LOGPROB_ATOL)
        assert o.finish_reason == "length" and o.prompt_token_ids == r.prompt_token_ids


def test_switch_mid_decode_2xtp1_tp2_2xtp1_equals_unswitched(pool, unswitched):
    assert pool.layout == Layout.uniform(2, 1)
    reqs = _requests("s")
    pool.add_requests(_split(reqs, 2))
    done = _run(pool, steps=4)
    assert not done
    seen = {rid: len(t.token_ids) for rep in pool.replicas for rid, t in rep.tracked.items()}
    assert sorted(seen) == [r.request_id for r in reqs] and all(0 < n < MAX_NEW for n in seen.values()), seen

    res = pool.reconfigure(2, {r.request_id: i % 2 for i, r in enumerate(reqs)})
    assert pool.layout == Layout.uniform(2, 2) and res.dst == pool.layout
    assert sorted(res.recomputed) == sorted(seen) and set(res.assignment.values()) == {0}
    assert [(i["device"], i["replica"], i["tp_rank"]) for i in pool.info()] == [(0, 0, 0), (1, 0, 1)]
    done.update(_run(pool, steps=4))
    mid = {rid: len(t.token_ids) for rep in pool.replicas for rid, t in rep.tracked.items()}
    assert all(seen[rid] < n < MAX_NEW for rid, n in mid.items()), (seen, mid)  # TP2 decoded, not finished

    res = pool.reconfigure(1, {rid: 0 for rid in mid})
    assert pool.layout == Layout.uniform(2, 1) and sorted(res.recomputed) == sorted(mid)
    assert set(res.assignment.values()) == {0, 1}
    done.update(_run(pool))
    assert sorted(done) == sorted(r.request_id for r in reqs)
    for rid, o in done.items():
        ref = unswitched[rid[1:]]
        assert o.token_ids == ref.token_ids, rid
        assert o.log_probs == pytest.approx(ref.log_probs, abs=LOGPROB_ATOL), rid
        assert o.finish_reason == "length"
