"""Mid-decode layout switch on real SGLang engines (tiny Qwen3, CPU): 2 x TP=1 -> 1 x TP=2 -> 2 x TP=1.

Requests are exported from running engines (abort: exact tokens and log-probs so far) and continued on
the other layout by recomputation (re-prefill of prompt + generated tokens). Greedy outputs must equal
an unswitched run token for token, and log-probs must agree closely.
"""

from __future__ import annotations

import pytest

# "sglang.srt": a bare "sglang" could resolve to a namespace package of a same-named folder on sys.path.
pytest.importorskip("sglang.srt")

from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(tiny_models):
    """Two TP=1 replicas and one TP=2 replica of the same checkpoint, all alive at once."""
    from pat_rollout.sglang.engine import SGLangEngine

    path = tiny_models["qwen3"]
    made = []
    try:
        for tp in (1, 1, 2):
            made.append(SGLangEngine(path, tp_size=tp, watchdog_timeout=120))
        yield tuple(made)
    finally:
        for e in made:
            e.shutdown()


def _requests(max_new: int) -> list[Request]:
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [Request(request_id=f"r{i}", prompt_token_ids=tuple(range(3 + 5 * i, 10 + 7 * i)), sampling=sp)
            for i in range(4)]


def test_qwen3_tp1_and_tp2_equal_hf(engines, tiny_models, hf_reference):
    a, _b, c = engines
    reqs = _requests(12)
    for eng in (a, c):
        eng.add_requests(reqs)
        outs = {o.request_id: o for o in eng.run_to_completion()}
        for r in reqs:
            ref_ids, ref_lps = hf_reference(tiny_models["qwen3"], list(r.prompt_token_ids), 12)
            assert list(outs[r.request_id].token_ids) == ref_ids, (eng.tp_size, r.request_id)
            assert outs[r.request_id].log_probs == pytest.approx(ref_lps, abs=LOGPROB_ATOL)


def test_switch_2xtp1_to_tp2_and_back_equals_unswitched(engines):
    a, b, c = engines
    max_new = 64
    reqs = _requests(max_new)
    a.add_requests(reqs)
    reference = {o.request_id: o for o in a.run_to_completion()}

    done = {}

    def collect(outputs):
        for o in outputs:
            done[o.request_id] = o

    # Phase 1: 2 x TP=1, then export mid-decode.
    a.add_requests(reqs[:2])
    b.add_requests(reqs[2:])
    collect(a.step(4).finished)
    collect(b.step(4).finished)
    states = a.export_requests() + b.export_requests()
    assert states, "nothing was running at the first switch"
    for s in states:
        assert 0 < len(s.output_token_ids) < max_new, s
        assert len(s.output_log_probs) == len(s.output_token_ids)
    first_cut = {s.request_id: len(s.output_token_ids) for s in states}

    # Phase 2: 1 x TP=2 continues them by recomputation, then export again.
    c.import_requests(states)
    collect(c.step(5).finished)
    states = c.export_requests()
    assert states, "nothing was running at the second switch"
    for s in states:
        assert first_cut[s.request_id] < len(s.output_token_ids) < max_new, s

    # Phase 3: back to 2 x TP=1.
    a.import_requests(states[::2])
    b.import_requests(states[1::2])
    for eng in (a, b, c):
        collect(eng.run_to_completion())
        assert not eng.has_unfinished()

    assert sorted(done) == sorted(reference)
    for rid, ref in reference.items():
        out = done[rid]
        assert out.finish_reason == "length"
        assert out.token_ids == ref.token_ids, rid
        assert len(out.log_probs) == max_new
        assert out.log_probs == pytest.approx(ref.log_probs, abs=LOGPROB_ATOL)
