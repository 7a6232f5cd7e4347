"""The pure parts of `bench.vllm_stock` (no vLLM needed): the skewed batch, the dealing of requests to replicas,
the per-request token clock, and the pool-vs-stock table (ratios per round, token equality)."""

from __future__ import annotations

from pat_rollout.bench.sglang_pat_vs_static import print_step_table
from pat_rollout.bench.sglang_stock import ChunkClock
from pat_rollout.bench.vllm_stock import deal, record, skewed_batch


def test_skewed_batch_lengths_and_determinism():
    reqs = skewed_batch(8, 2, 12, 48, vocab=256)
    assert [r.sampling.max_new_tokens for r in reqs] == [48, 48] + [12] * 6
    assert all(r.sampling.ignore_eos and r.sampling.temperature == 0 for r in reqs)
    assert all(8 <= len(r.prompt_token_ids) <= 64 and all(3 <= t < 256 for t in r.prompt_token_ids) for r in reqs)
    assert [r.prompt_token_ids for r in skewed_batch(8, 2, 12, 48, vocab=256)] == [r.prompt_token_ids for r in reqs]


def test_deal_round_robin():
    reqs = skewed_batch(5, 1, 4, 8, vocab=64)
    assert {r: [q.request_id for q in qs] for r, qs in deal(reqs, 2).items()} == {0: ["s0", "s2", "s4"],
                                                                                  1: ["s1", "s3"]}
    assert [q.request_id for q in deal(reqs, 1)[0]] == [f"s{i}" for i in range(5)]


def test_record_and_step_times():
    clock, seen = ChunkClock(), {}
    # a: first token at t=1 (prefill), then 4 more tokens by t=3 -> 0.5 s per token; b: never decodes past its first
    for t, n in [(1.0, 1), (2.0, 3), (2.5, 3), (3.0, 5)]:
        record(clock, seen, "a", n, t)
    record(clock, seen, "b", 1, 1.0)
    assert clock.chunks == {"a": [(1.0, 1), (2.0, 2), (3.0, 2)], "b": [(1.0, 1)]}
    assert clock.step_times() == [0.5]


def test_pool_stock_table(capsys):
    step = {"pool TP1": [2.0, 3.0, 4.0], "stock TP1": [2.0, 2.0, 5.0],
            "pool TP2": [1.0, 1.0, 1.0], "stock TP2": [1.0, 1.0, 1.0]}
    tokens = {k: [[(1, 2)]] * 3 for k in step}
    assert print_step_table([1, 2], 2, step, tokens, stock_label="stock vLLM", scale=1.0, title="T")
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "T" and "stock vLLM" in out[2]
    # 2xTP1: per-round ratios 1.0, 1.5, 0.8 -> median 1.000 [0.800-1.500]
    assert out[3].split()[0] == "2xTP1" and "1.000 [0.800-1.500]" in out[3] and out[3].endswith("True")
    assert out[4].split()[0] == "1xTP2" and "1.000 [1.000-1.000]" in out[4]
    tokens["stock TP2"] = [[(1, 2)], [(1, 3)], [(1, 2)]]
    assert not print_step_table([1, 2], 2, step, tokens)
    assert capsys.readouterr().out.splitlines()[4].endswith("False")
