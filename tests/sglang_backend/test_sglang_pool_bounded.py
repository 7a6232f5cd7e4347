"""The SGLang pool's switch memory, measured in the scheduler processes (real SGLang, CPU), and its weight backup.

- A shrink (1 x TP2 -> 2 x TP1) expands every parameter inside its own storage: the peak extra bytes of the reshard
  (`comm.alloc_spy.AllocSpy` in each rank, PAT_SGLANG_ALLOC_SPY=1) stay within one transfer chunk
  (PatRolloutConfig.transfer_chunk_bytes), where assembling new shards took about half the model per rank.
- The KV hand-off of many requests holds at most the cap of migrated KV per rank (kv_handoff_max_bytes: the driver
  recomputes the requests over it) plus about two chunks of scratch; greedy outputs still equal HF.
- One host backup per weight sync, not per bucket: taken by `end_weight_update` (or by the next switch when nobody
  called it); a failed switch after a sync rolls back to exactly the synced weights.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("sglang.srt")

from test_sglang_pool import _check_equal_hf, _config, _requests, _wait_tokens  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

CHUNK = 4096
CAP = 48 << 10


@pytest.mark.timeout(600)
def test_shrink_and_handoff_peak_bytes_within_chunk_and_cap(tiny_models, hf_reference, monkeypatch):
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.sglang.pool_switch import ALLOC_SPY_ENV

    monkeypatch.setenv(ALLOC_SPY_ENV, "1")  # inherited by the scheduler processes
    path = tiny_models["llama"]
    cfg = dataclasses.replace(_config(path, "migrate"), transfer_chunk_bytes=CHUNK, kv_handoff_max_bytes=CAP)
    driver = RolloutDriver(cfg)
    # 240 new tokens, not 96: both switches need every request still running (the cap recomputes some of them only
    # when the running requests' KV exceeds it). The replicas decode independently, and in a CI run at load ~12 on
    # 2 cores replica 1 finished all six of its 96-token requests before replica 0's reached 8 tokens.
    reqs = _requests("b", 12, max_new=240)
    try:
        futures = {r.request_id: driver.submit(r) for r in reqs}
        switches = []
        for tp, n in ((2, 8), (1, 40)):
            _wait_tokens(driver, futures, n)
            driver.reconfigure(tp)
            switches.append((driver.last_reconfig, driver.pool.last_switch))
        outs = {rid: f.result(timeout=300) for rid, f in futures.items()}
        _check_equal_hf(outs, reqs, path, hf_reference)
        (grow, grow_ranks), (shrink, shrink_ranks) = switches
        # the shrink's reshard: every rank keeps what it held (TP1 holds all), receives the rest in place
        spec = driver.pool.spec
        model_bytes = 4 * spec.num_params()
        for r in shrink_ranks:
            assert r["params_in_place"] == r["params_total"] > 0
            assert 0 < r["reshard_peak_bytes"] <= CHUNK, r["reshard_peak_bytes"]
            assert model_bytes / 2 > 20 * CHUNK  # what the old shrink allocated per rank (about one TP2 shard)
        # the hand-offs: capped, so some requests recomputed; peak = received KV (<= cap) + scratch
        per_token = {tp: spec.kv_bytes_per_token(tp, 4) for tp in (1, 2)}
        for result, ranks, tp in ((grow, grow_ranks, 2), (shrink, shrink_ranks, 1)):
            assert result.migrated and result.recomputed, (tp, result.migrated, result.recomputed)
            for r in ranks:
                assert 0 < r["kv_peak_bytes"] <= CAP + 2 * CHUNK + per_token[tp], (tp, r["kv_peak_bytes"])
        # without the cap these requests' KV is far more than the cap on a TP1 rank
        all_kv = sum((len(r.prompt_token_ids) + 40) * per_token[1] for r in reqs) / 2
        assert all_kv > 2 * CAP
    finally:
        driver.shutdown()


@pytest.mark.timeout(600)
def test_one_backup_per_sync_and_rollback_restores_synced_weights(tiny_models, tmp_path):
    import torch
    from safetensors.torch import load_file

    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.driver.errors import ReconfigurationError
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.pool import SglPool, check_model

    path = tiny_models["llama"]
    cfg = PatRolloutConfig(model_path=path, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", dtype="float32")
    pool = SglPool(cfg, check_model(cfg), Layout.uniform(2, 1), device="cpu")

    def backups() -> list[int]:
        return [i["backups"] for i in pool.info()]

    def params(tag: str) -> list[dict]:
        return [p["params"] for p in pool.save_params(str(tmp_path / tag))]

    def sync(weights: dict, delta: float, num_buckets: int) -> None:
        items = [(n, t + delta) for n, t in sorted(weights.items())]
        for b in range(num_buckets):
            pool.update_weights(items[b::num_buckets])

    try:
        weights = load_file(f"{path}/model.safetensors")
        assert backups() == [1, 1]  # start-up
        sync(weights, 0.01, 4)
        assert backups() == [1, 1]  # four buckets, no backup yet
        synced = params("synced")
        pool.end_weight_update()
        pool.end_weight_update()  # nothing new since: no second copy
        assert backups() == [2, 2]
        pool.reconfigure(2, {})
        pool.reconfigure(1, {})
        assert backups() == [2, 2]  # switches take none while the backup is current
        assert all(torch.equal(a[n], b[n]) for a, b in zip(params("back"), synced) for n in a)

        sync(weights, 0.02, 3)  # a second sync, and nobody calls end_weight_update
        synced2 = params("synced2")
        assert any(not torch.equal(synced2[0][n], synced[0][n]) for n in synced[0])
        pool.fail_next("import", rank=0)  # the switch takes the backup first, then fails: rollback restores it
        with pytest.raises(ReconfigurationError, match="rolled back to base layout"):
            pool.reconfigure(2, {})
        assert backups() == [3, 3]
        restored = params("restored")
        for rank in (0, 1):
            assert restored[rank].keys() == synced2[rank].keys()
            for n in synced2[rank]:
                assert torch.equal(restored[rank][n], synced2[rank][n]), (rank, n)
    finally:
        pool.shutdown()
