"""The replicas of an SglPool layout run independently (real SGLang, CPU): a long prefill on one replica does not
stall another replica's decode.

Rank 0 reads every request and routes it to its replica's leader (`replica_input`); only the ranks of one replica
synchronise. In 2 x TP1, replica 1 decodes one long request while replica 0 prefills a long prompt. Every rank logs
the start and end of each forward (`debug_hooks`, PAT_SGLANG_STEP_LOG): replica 1 keeps decoding during replica
0's prefill: it starts decode steps inside it. In lockstep (SGLang's broadcast of every
request over the whole pool at the top of each iteration) replica 1 could start at most one decode step per
iteration of replica 0, so none would start inside the prefill after the first.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.sglang.debug_hooks import STEP_LOG_ENV, read_step_logs  # noqa: E402
from pat_rollout.sglang.pool_hooks import REPLICA_INPUT_ENV  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# Wider than the tests' tiny Llama so that a long prompt's prefill takes far longer than one decode step.
WIDE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            max_position_embeddings=4096)
LONG_PROMPT = 3000


@pytest.mark.timeout(600)
def test_long_prefill_on_one_replica_does_not_stall_the_other(tmp_path, monkeypatch):
    from pat_rollout.layout import Layout
    from pat_rollout.models import make_tiny_model
    from pat_rollout.sglang.pool import SglPool, check_model

    log_dir = tmp_path / "steps"
    log_dir.mkdir()
    monkeypatch.setenv(STEP_LOG_ENV, str(log_dir))  # inherited by the scheduler processes
    monkeypatch.delenv(REPLICA_INPUT_ENV, raising=False)  # the default: per-replica input
    path = str(make_tiny_model(tmp_path / "wide", "llama", **WIDE))
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", dtype="float32",
                           engine_args={"max_total_tokens": 4096, "chunked_prefill_size": 4096})
    pool = SglPool(cfg, check_model(cfg), Layout.uniform(2, 1), device="cpu")
    try:
        decode = Request(request_id="decode", prompt_token_ids=tuple(range(3, 11)),
                         sampling=SamplingParams(max_new_tokens=600, ignore_eos=True))
        prefill = Request(request_id="prefill", prompt_token_ids=tuple(3 + i % 200 for i in range(LONG_PROMPT)),
                          sampling=SamplingParams(max_new_tokens=2, ignore_eos=True))
        pool.add_requests({1: [decode]})
        pool.client.loop.run_until_complete(asyncio.sleep(1.0))  # replica 1 is decoding
        pool.add_requests({0: [prefill]})
        outs = {o.request_id: o for o in pool.client.run_to_completion(timeout=300)}
    finally:
        pool.shutdown()
    assert len(outs["decode"].token_ids) == 600 and len(outs["prefill"].token_ids) == 2

    logs = read_step_logs(str(log_dir))
    long_extends = [s for s in logs[0] if s["mode"] == "extend" and (s["tokens"] or 0) >= LONG_PROMPT // 2]
    assert long_extends, f"rank 0 logged no long prefill: {logs[0][:5]}"
    t0, t1 = min(s["t0"] for s in long_extends), max(s["t1"] for s in long_extends)
    decodes = [s for s in logs[1] if s["mode"] == "decode"]
    assert all(s["mode"] != "extend" or s["tokens"] < 100 for s in logs[1])  # replica 1 never saw the long prompt
    step_s = statistics.median(s["t1"] - s["t0"] for s in decodes)
    before = [s["t0"] for s in decodes if s["t1"] < t0]
    gap_before = statistics.median(b - a for a, b in zip(before, before[1:])) if len(before) > 1 else float("nan")
    inside = [s["t0"] for s in decodes if t0 <= s["t0"] <= t1]
    gaps = [b - a for a, b in zip([t0, *inside], [*inside, t1])]
    msg = (f"prefill {t1 - t0:.3f} s on rank 0; rank 1: decode step {step_s * 1e3:.1f} ms, median gap before "
           f"{gap_before * 1e3:.1f} ms, {len(inside)} decode steps started inside, max gap "
           f"{max(gaps) * 1e3:.1f} ms")
    print(msg)
    # What separates the two behaviours, whatever this machine's speed or load: in lockstep replica 1 starts at most
    # one decode step inside the prefill (it waits on rank 0's broadcast at the top of every iteration, and rank 0
    # is in the prefill's forward); independent replicas keep decoding through it (seen: 15-51 steps started inside
    # a 1.0-29 s prefill). The count is the separation. The longest gap is printed, not asserted: under load the OS
    # can deschedule rank 1 for most of a prefill (seen: 20.6 s of a 29.4 s prefill at load 20 on 2 cores) without
    # any lockstep, so a bound on it would measure the machine, not the pool.
    assert len(inside) >= 2, msg
