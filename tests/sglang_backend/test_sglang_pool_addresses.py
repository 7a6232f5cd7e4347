"""Stable parameter and KV addresses on the SGLang pool (real SGLang, CPU): what CUDA graphs per layout need.

A captured CUDA graph replays kernels with the addresses it was captured with, so a graph per layout stays valid only
if every layout's parameters and KV buffers are back at the same addresses each time the pool enters it. The
switches keep every parameter storage whole (`reshard_local(keep_storage=True)`: a grow compacts in place, a
shrink assembles in a temporary and copies back) and the KV room re-views the same storage, so every layout's
tensors start at the base layout's addresses; the module tree built for a layout (its buffers: rotary caches) is
kept and reused each time the pool enters it (`pool_switch._rebuild`). Checked here through grow, shrink, a weight update, a failed switch
and its rollback; greedy outputs then still equal HF (the values are right, not only the addresses). Graphs
themselves need a GPU (not run here). Also here: idle ranks sleep instead of spinning, followers never.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _addresses(pool) -> list[tuple[dict[str, int], list]]:
    """Per rank: parameter addresses and KV storage addresses."""
    return [(i["param_ptrs"], i["kv_storage"]) for i in pool.info()]


def _idle_window(pool, seconds: float = 1.0) -> tuple[list[float], float]:
    """Seconds each rank spent in its idle sleep while the test slept `seconds` (between two info RPCs: each rank's
    window between them holds the whole sleep), and `seconds`."""
    before = [i["idle"]["slept_s"] for i in pool.info()]
    time.sleep(seconds)
    after = [i["idle"]["slept_s"] for i in pool.info()]
    return [a - b for a, b in zip(after, before)], seconds


def _models(pool) -> list[int]:
    return [i["model_id"] for i in pool.info()]


def _shapes(pool) -> list[dict[str, list[int]]]:
    return [i["params"] for i in pool.info()]


@pytest.mark.timeout(600)
def test_addresses_hold_through_switches_weight_update_and_rollback(tiny_models, hf_reference):
    from safetensors.torch import load_file

    from pat_rollout.driver.errors import ReconfigurationError
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.pool import SglPool, check_model

    path = tiny_models["llama"]
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", dtype="float32")
    pool = SglPool(cfg, check_model(cfg), Layout.uniform(2, 1), device="cpu")
    try:
        base, base_shapes, base_models = _addresses(pool), _shapes(pool), _models(pool)
        # idle ranks sleep until input arrives (replica_input.sleep_until_input): in 2 x TP1 both lead and sleep
        # through most of an idle second; a spinning rank would not sleep at all
        slept, wall = _idle_window(pool)
        assert all(s > 0.5 * wall for s in slept), (slept, wall)
        pool.reconfigure(2, {})
        slept, wall = _idle_window(pool)  # 1 x TP2: rank 0 leads and sleeps, rank 1 waits in its broadcast
        assert slept[0] > 0.5 * wall and slept[1] == 0, (slept, wall)
        grown_shapes, grown_models = _shapes(pool), _models(pool)
        assert grown_shapes != base_shapes  # really resharded
        assert _addresses(pool) == base  # every TP2 shard starts where its TP1 tensor did
        pool.reconfigure(1, {})
        assert _addresses(pool) == base and _shapes(pool) == base_shapes
        assert _models(pool) == base_models  # the module tree SGLang built (and its buffers) is back

        weights = load_file(f"{path}/model.safetensors")
        pool.update_weights(list(weights.items()))  # verl's weight sync (same values: outputs stay HF's)
        assert _addresses(pool) == base
        pool.reconfigure(2, {})
        assert _addresses(pool) == base and _shapes(pool) == grown_shapes
        assert _models(pool) == grown_models  # the TP2 module tree built at the first grow, not a new one

        pool.reconfigure(1, {})
        pool.fail_next("import", rank=0)  # rank 1 finishes the switch, rank 0 fails: rollback from the host backup
        with pytest.raises(ReconfigurationError, match="rolled back to base layout"):
            pool.reconfigure(2, {})
        assert _addresses(pool) == base and _shapes(pool) == base_shapes and _models(pool) == base_models

        sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
        reqs = [Request(request_id=f"a{i}", prompt_token_ids=tuple(range(3 + 5 * i, 12 + 7 * i)), sampling=sp)
                for i in range(2)]
        pool.add_requests({0: reqs[:1], 1: reqs[1:]})
        outs = {o.request_id: o for o in pool.client.run_to_completion(timeout=300)}
        for r in reqs:
            assert list(outs[r.request_id].token_ids) == hf_reference(path, list(r.prompt_token_ids), 24)[0]
    finally:
        pool.shutdown()
