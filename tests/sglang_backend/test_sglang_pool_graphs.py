"""Decode graphs per layout on the SGLang pool (real SGLang, CPU): each layout keeps its own attention backends and
graph runner (`layout_graphs`), all captured at start-up.

Graphs need a GPU, so the capture here is a recording one (`PAT_SGLANG_FAKE_GRAPHS=1`: `FakeGraphRunner` notes the
TP group size, module tree, attention backend and a parameter address it was captured with, and never replays).
What is checked is what the GPU path relies on: SGLang's own start-up capture runs under the base layout's group
(TP1 on this 2-rank pool, not the WORLD's TP2: what `compat.build_methods` wraps), every other layout is captured at
start-up under its group with its modules and backend (`pool_startup`), so a switch captures nothing; leaving and
re-entering a layout (also through a failed switch's rollback) restores the very runner and backend objects kept for
it; greedy outputs still equal HF; a capture that fails at start-up rolls back and fails the start-up with an error
naming the layout.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.sglang.layout_graphs import FAKE_GRAPHS_ENV  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _graphs(pool) -> list[dict]:
    """Per rank: the current graph runner (as `layout_graphs.describe` says), attention backend and model ids."""
    return [dict(runner=i["graphs"]["current"], attention=i["attention_id"], model=i["model_id"],
                 first_param=next(iter(i["param_ptrs"].values())), layouts=i["graphs"]["layouts"])
            for i in pool.info()]


@pytest.mark.timeout(600)
def test_each_layout_replays_its_own_graphs_and_backends(tiny_models, hf_reference, monkeypatch):
    from pat_rollout.driver.errors import ReconfigurationError
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.pool import SglPool, check_model

    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")  # inherited by the scheduler processes
    path = tiny_models["llama"]
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", dtype="float32")
    pool = SglPool(cfg, check_model(cfg), Layout.uniform(2, 1), device="cpu")
    try:
        assert all(i["graphs"]["on"] for i in pool.info())
        st = pool.startup
        assert st.graphs_on and st.captured == {1, 2} and st.capture_s[2] > 0
        assert st.pending_capture_s(2) == 0 and st.pending_capture_s(1) == 0
        assert st.metrics()["pat/comm_bytes_per_gpu"] == 0  # gloo: no device communicators on CPU
        base = _graphs(pool)
        assert [g["layouts"] for g in base] == [[1, 2], [1, 2]]
        for g in base:  # SGLang's start-up capture, under the base layout's TP1 group (not the WORLD's TP2)
            assert g["runner"]["type"] == "FakeGraphRunner" and g["runner"]["tp"] == 1
            assert g["runner"]["model_id"] == g["model"] and g["runner"]["attention_id"] == g["attention"]
            assert g["runner"]["param_ptr"] == g["first_param"]

        first = pool.reconfigure(2, {})
        grown = _graphs(pool)
        for g in grown:  # captured at start-up, under the TP2 group, with the TP2 modules and a new attention backend
            assert g["runner"]["type"] == "FakeGraphRunner" and g["runner"]["tp"] == 2
            assert g["runner"]["model_id"] == g["model"] and g["runner"]["attention_id"] == g["attention"]
            assert g["runner"]["param_ptr"] == g["first_param"]
            assert g["layouts"] == [1, 2]
        assert [g["attention"] for g in grown] != [g["attention"] for g in base]
        assert first.phase_s["capture"] == 0  # nothing left to capture in a switch

        back = pool.reconfigure(1, {})
        assert _graphs(pool) == base  # the base layout's own objects again
        assert back.phase_s["capture"] == 0

        again = pool.reconfigure(2, {})
        assert _graphs(pool) == grown  # the runner captured at start-up: same objects, no new capture
        assert again.phase_s["capture"] == 0

        pool.reconfigure(1, {})
        pool.fail_next("import", rank=0)  # after the capture phase: rank 0 fails, both roll back
        with pytest.raises(ReconfigurationError, match="rolled back to base layout"):
            pool.reconfigure(2, {})
        assert _graphs(pool) == base

        sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
        reqs = [Request(request_id=f"g{i}", prompt_token_ids=tuple(range(3 + 5 * i, 12 + 7 * i)), sampling=sp)
                for i in range(2)]
        pool.reconfigure(2, {})
        pool.add_requests({0: reqs})
        outs = {o.request_id: o for o in pool.client.run_to_completion(timeout=300)}
        for r in reqs:
            assert list(outs[r.request_id].token_ids) == hf_reference(path, list(r.prompt_token_ids), 24)[0]
    finally:
        pool.shutdown()


@pytest.mark.timeout(600)
def test_a_capture_that_fails_at_startup_rolls_back_and_names_the_layout(tiny_models, monkeypatch):
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.layout_graphs import FAKE_FAIL_ENV
    from pat_rollout.sglang.pool import SglPool, check_model
    from pat_rollout.sglang.pool_startup import GraphCaptureError

    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    monkeypatch.setenv(FAKE_FAIL_ENV, "2:1")  # rank 1's capture of TP2 raises
    cfg = PatRolloutConfig(model_path=tiny_models["llama"], num_devices=2, backend="sglang", initial_tp=1,
                           candidate_tps=(1, 2), policy="manual", dtype="float32")
    with pytest.raises(GraphCaptureError, match=r"(?s)decode graphs of layout TP2 failed.*rolled back to its base "
                       r"layout.*rank 1 failed in phase switch: RuntimeError: injected capture failure of TP2 on rank 1"):
        SglPool(cfg, check_model(cfg), Layout.uniform(2, 1), device="cpu")
