"""Unseeded temperature-1 sampling (what RL rollouts do) on the SGLang pool across 2 x TP1 -> 1 x TP2 -> 2 x TP1.

SGLang does not exchange sampled token ids between the ranks of a TP group; it relies on identical RNG states.
In 2 x TP1 the two ranks run different batches, so their states diverge; unless the switch reseeds the ranks of
each new replica alike (`pool_switch._reseed`), the two ranks of the TP2 replica sample different tokens, feed
different embeddings into the same all-reduces, and when one reaches EOS first the other is left in a collective.
Every rank logs what it sampled per batch (`debug_hooks`, PAT_SGLANG_SAMPLED_LOG): in every TP2 batch both ranks
must have sampled the same ids. Several pool seeds (the engine's random_seed; SGLang ignores per-request seeds
without deterministic inference); every wait is bounded.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("sglang.srt")

from test_sglang_pool import _config, _run_with_switches  # noqa: E402

from pat_rollout.sglang.debug_hooks import LOG_ENV, read_sampled_logs, replica_mismatches  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def skewed_sampled(tag: str) -> list[Request]:
    """Two long requests and four short ones, temperature 1; only the long ones ignore EOS (so a switch always
    finds them running), the others may stop at EOS as RL rollouts do."""
    lens = (96, 96, 10, 14, 30, 44)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=tuple(range(3 + 5 * i, 12 + 7 * i)),
                    sampling=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=i < 2))
            for i, n in enumerate(lens)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,handoff,seed", [("llama", "migrate", 0), ("qwen3", "recompute", 1),
                                               ("llama", "migrate", 12345)])
def test_unseeded_sampling_tp2_ranks_agree(tiny_models, hf_reference, tmp_path, monkeypatch, arch, handoff, seed):
    from pat_rollout.driver import RolloutDriver

    log_dir = tmp_path / "sampled"
    log_dir.mkdir()
    monkeypatch.setenv(LOG_ENV, str(log_dir))  # inherited by the scheduler processes the pool spawns
    path = tiny_models[arch]
    reqs = skewed_sampled("u")
    driver = RolloutDriver(dataclasses.replace(_config(path, handoff), seed=seed))
    try:
        outs, (grow, shrink) = _run_with_switches(driver, reqs, at=(6, 36))
        per_rank = driver.pool.last_switch  # the shrink's report from each rank
    finally:
        driver.shutdown()
    assert str(grow.dst).startswith("1xTP2") and str(shrink.dst).startswith("2xTP1")
    assert {o.finish_reason for o in outs.values()} <= {"length", "stop"}
    for r in reqs:
        assert 1 <= len(outs[r.request_id].token_ids) <= r.sampling.max_new_tokens
    print(f"reseed per rank (s): {[r['phase_s']['reseed'] for r in per_rank]}")

    logs = read_sampled_logs(str(log_dir))
    assert sorted(logs) == [0, 1]
    compared, bad = replica_mismatches(logs, tp=2)
    assert compared >= 10, f"only {compared} TP2 batches logged"  # the TP2 phase really decoded
    assert not bad, "ranks of the TP2 replica sampled different tokens:\n" + "\n".join(bad[:10])
    # really sampled at temperature 1: the long requests leave greedy decoding
    greedy = [hf_reference(path, list(r.prompt_token_ids), r.sampling.max_new_tokens)[0] for r in reqs[:2]]
    assert any(list(outs[r.request_id].token_ids) != g for r, g in zip(reqs[:2], greedy))


def test_abort_with_the_final_token_counts_as_finished():
    """An abort that lands in the step sampling a request's last token (budget used up, or EOS) ends its stream
    as "abort" with every token: the switch must finish it, not resubmit it with nothing left to generate."""
    from pat_rollout.sglang.engine import SGLangEngine, _Tracked

    eng = SGLangEngine.__new__(SGLangEngine)  # no engine: _complete reads only eos_token_ids
    eng.eos_token_ids = (2,)

    def tracked(ids, **sp):
        return _Tracked(request_id="r", prompt=(5,), sampling=SamplingParams(temperature=1.0, **sp), rid="x",
                        new_ids=list(ids))

    assert eng._complete(tracked([7, 8, 9], max_new_tokens=3)) == "length"
    assert eng._complete(tracked([7, 2], max_new_tokens=9)) == "stop"
    assert eng._complete(tracked([7, 2], max_new_tokens=9, ignore_eos=True)) is None
    assert eng._complete(tracked([7, 4], max_new_tokens=9, stop_token_ids=(4,))) == "stop"
    assert eng._complete(tracked([7, 8], max_new_tokens=9)) is None
