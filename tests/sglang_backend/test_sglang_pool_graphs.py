"""Decode graphs per layout on the SGLang pool (real SGLang, CPU): each layout keeps its own attention backends and
graph runner (`layout_graphs`).

Graphs need a GPU, so the capture here is a recording one (`PAT_SGLANG_FAKE_GRAPHS=1`: `FakeGraphRunner` notes the
TP group size, module tree, attention backend and a parameter address it was captured with, and never replays).
What is checked is what the GPU path relies on: the first entry into a layout captures under that layout's group
with that layout's modules and backend, and is timed as the switch phase "capture"; leaving and re-entering a
layout (also through a failed switch's rollback) restores the very runner and backend objects kept for it, with no
new capture; greedy outputs still equal HF.
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
        base = _graphs(pool)
        assert [g["layouts"] for g in base] == [[], []]
        assert all(g["runner"]["type"] != "FakeGraphRunner" for g in base)  # SGLang's own (none on CPU)

        first = pool.reconfigure(2, {})
        grown = _graphs(pool)
        for g in grown:  # captured now, under the TP2 group, with the TP2 modules and a new attention backend
            assert g["runner"]["type"] == "FakeGraphRunner" and g["runner"]["tp"] == 2
            assert g["runner"]["model_id"] == g["model"] and g["runner"]["attention_id"] == g["attention"]
            assert g["runner"]["param_ptr"] == g["first_param"]
            assert g["layouts"] == [1, 2]
        assert [g["attention"] for g in grown] != [g["attention"] for g in base]
        assert first.phase_s["capture"] > 0

        back = pool.reconfigure(1, {})
        assert _graphs(pool) == [{**g, "layouts": [1, 2]} for g in base]  # the base layout's own objects again
        assert back.phase_s["capture"] == 0

        again = pool.reconfigure(2, {})
        assert _graphs(pool) == grown  # the runner captured at the first grow: same objects, no new capture
        assert again.phase_s["capture"] == 0

        pool.reconfigure(1, {})
        pool.fail_next("import", rank=0)  # after the capture phase: rank 0 fails, both roll back
        with pytest.raises(ReconfigurationError, match="rolled back to base layout"):
            pool.reconfigure(2, {})
        assert _graphs(pool) == [{**g, "layouts": [1, 2]} for g in base]

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
