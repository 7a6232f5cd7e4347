"""Seeded sampling depends only on (seed, output position): not on the batch or on preemption."""

from __future__ import annotations

import torch
from ref_helpers import make_engine, make_requests

from pat_rollout.engine.ref.sampler import filter_logits
from pat_rollout.types import Request, SamplingParams


def _sampled(seed: int, rid: str = "x") -> Request:
    (r,) = make_requests([6], [24], prompt_seed=3, temperature=1.2, top_k=50, top_p=0.95, seed=seed)
    return Request(request_id=rid, prompt_token_ids=r.prompt_token_ids, sampling=r.sampling)


def test_seeded_sampling_is_batch_independent(tiny_models):
    engine = make_engine(tiny_models["qwen3"], block_size=4)
    alone = engine.generate([_sampled(7)])[0]
    others = make_requests([4, 12, 9], [30, 8, 20], prompt_seed=1, temperature=0.7, seed=99) \
        + make_requests([5], [10], prompt_seed=2, prefix="g")
    crowded = {o.request_id: o for o in engine.generate([*others[:2], _sampled(7), *others[2:]])}
    assert crowded["x"].token_ids == alone.token_ids
    # Preemption (recompute) under a tiny cache does not change the draw either.
    small = make_engine(tiny_models["qwen3"], block_size=4, num_kv_blocks=9)
    assert {o.request_id: o for o in small.generate([*others, _sampled(7)])}["x"].token_ids == alone.token_ids
    twin = {o.request_id: o for o in engine.generate([_sampled(7, "a"), _sampled(7, "b"), _sampled(8, "c")])}
    assert twin["a"].token_ids == twin["b"].token_ids == alone.token_ids
    assert twin["c"].token_ids != alone.token_ids
    greedy = engine.generate([make_requests([6], [24], prompt_seed=3)[0]])[0]
    assert greedy.token_ids != alone.token_ids


def test_log_probs_are_raw_policy_log_probs(tiny_models):
    engine = make_engine(tiny_models["llama"])
    hot = engine.generate([_sampled(1)])[0]
    # Same prefix fed greedily: the raw log-prob of a forced continuation equals the reported one.
    forced = Request(request_id="f", prompt_token_ids=(*_sampled(1).prompt_token_ids, *hot.token_ids[:5]),
                     sampling=SamplingParams(max_new_tokens=1, stop_token_ids=()))
    out = engine.generate([forced])[0]
    if out.token_ids[0] == hot.token_ids[5]:
        assert abs(out.log_probs[0] - hot.log_probs[5]) < 1e-9
    assert all(lp <= 0 for lp in hot.log_probs)


def test_filter_logits():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0]], dtype=torch.float64)
    out = filter_logits(logits, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.5, 0.1], dtype=torch.float64))
    keep = torch.isfinite(out)
    assert keep.tolist() == [[True, False, True, False], [True, False, False, False], [False, False, True, False]]
    assert torch.equal(out[keep], logits[keep])
