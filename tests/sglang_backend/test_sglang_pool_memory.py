"""What the SGLang pool hands SGLang for memory: the memory saver's regions, ServerArgs, KV sizing.

- Every live parameter sits in storage allocated inside the memory saver's "weights" region, and every KV buffer
  inside "kv_cache", after start-up, a grow (2 x TP1 -> 1 x TP2), a shrink and a failed switch's rollback: those
  regions are what verl's `release_memory_occupation` frees. On CPU the saver is a no-op; `memory_spy`
  (PAT_SGLANG_MEMORY_SPY=1) records which storages each region allocated instead. Not tested here: that
  torch_memory_saver on a GPU really frees them (no GPU), and allocations of tensors that do not outlive the
  switch (KV hand-off buffers, transport buffers) are deliberately outside any region.
- The ServerArgs the engine runs with turn prefill (piecewise) CUDA graphs off and carry max_running_requests =
  max_num_seqs; initial_tp above the smallest TP size is refused before any process starts.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("sglang.srt")

from test_sglang_pool import _config, _requests, _wait_tokens  # noqa: E402

pytestmark = [pytest.mark.sglang]


def _regions(driver) -> list[dict]:
    return driver.pool._rpc("pat_memory_regions", path="")


def _assert_in_regions(driver, when: str) -> None:
    for rank, rep in enumerate(_regions(driver)):
        assert rep["spy"] and rep["num_params"] > 0 and rep["num_kv_buffers"] > 0, rep
        assert not rep["params_outside"], f"{when}, rank {rank}: parameters outside the weights region: " \
                                          f"{rep['params_outside']}"
        assert not rep["kv_outside"], f"{when}, rank {rank}: KV buffers outside the kv_cache region: " \
                                      f"{rep['kv_outside']}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_switch_allocations_in_memory_saver_regions_and_server_args(tiny_models, monkeypatch):
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.sglang import compat
    from pat_rollout.sglang.memory_spy import SPY_ENV
    from pat_rollout.sglang.pool import pool_engine_args
    from pat_rollout.workers.reconfigure import ReconfigurationError

    monkeypatch.setenv(SPY_ENV, "1")  # inherited by the scheduler processes
    cfg = dataclasses.replace(_config(tiny_models["qwen3"], "migrate"), max_num_seqs=48)
    driver = RolloutDriver(cfg)
    try:
        # ServerArgs as the engine resolved them (the scheduler processes got the same object)
        sa = driver.pool.client.sgl.server_args
        off = compat.prefill_graph_off_args()
        assert off and all(getattr(sa, name) is True for name in off), off
        assert sa.max_running_requests == 48 and sa.disable_cuda_graph is True
        assert {**off, "max_running_requests": 48}.items() <= pool_engine_args(cfg).items()
        assert pool_engine_args(cfg, max_running_requests=7)["max_running_requests"] == 7  # engine_args win

        _assert_in_regions(driver, "after start-up")
        driver.reconfigure(2)  # grow: in place (compacted storages are reallocated by resize_)
        _assert_in_regions(driver, "after the grow")
        driver.reconfigure(1)  # shrink: new shards received into fresh tensors
        _assert_in_regions(driver, "after the shrink")
        futures = {r.request_id: driver.submit(r) for r in _requests("m", 2)}
        _wait_tokens(driver, futures, 4)
        driver.pool.fail_next("switch")  # after the reshard: the rollback re-creates weights from the backup
        with pytest.raises(ReconfigurationError, match="rolled back"):
            driver.reconfigure(2)
        _assert_in_regions(driver, "after a rollback")
        assert all(f.result(timeout=240).finish_reason == "length" for f in futures.values())
    finally:
        driver.shutdown()


def test_initial_tp_above_smallest_tp_is_refused(tiny_models):
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.sglang.pool import check_model

    cfg = PatRolloutConfig(model_path=tiny_models["llama"], num_devices=2, backend="sglang", initial_tp=2,
                           candidate_tps=(1, 2), policy="manual")
    with pytest.raises(ValueError, match=r"initial_tp=2 is above the smallest TP size 1 of tp_sizes=\(1, 2\).*"
                                         r"weights \(1/2 per rank\).*TP1 would need 2x the weight memory"):
        check_model(cfg)
    # the static baseline in TP2 and PAT starting in the smallest TP are fine
    assert check_model(dataclasses.replace(cfg, policy="static")).num_kv_heads == 2
    assert check_model(dataclasses.replace(cfg, candidate_tps=(2,))).num_kv_heads == 2


def test_page_size_above_one_is_refused_before_start(tiny_models):
    """The KV hand-off needs single-token slots: page_size > 1 is refused by check_model (before any process starts)
    and by pool_engine_args (overrides), naming the option."""
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.sglang.pool import check_model, pool_engine_args

    cfg = PatRolloutConfig(model_path=tiny_models["llama"], num_devices=2, backend="sglang", initial_tp=1,
                           candidate_tps=(1, 2), policy="manual", engine_args={"page_size": 16})
    with pytest.raises(ValueError, match=r"engine_args\['page_size'\]=16 is not supported.*use page_size=1"):
        check_model(cfg)
    with pytest.raises(ValueError, match=r"engine_args\['page_size'\]=64"):
        pool_engine_args(dataclasses.replace(cfg, engine_args={}), page_size=64)
    assert check_model(dataclasses.replace(cfg, engine_args={"page_size": 1})).num_kv_heads == 2
    assert pool_engine_args(dataclasses.replace(cfg, engine_args={}), page_size=1)["page_size"] == 1
