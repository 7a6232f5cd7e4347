"""GPU checks of the SGLang pool's start-up graphs, communicators and NCCL abort (issue #35). Skipped without CUDA,
SGLang or PAT_SGLANG_GPU_MODEL (see test_sglang_gpu.py); each test says how many GPUs it needs.

- graphs on with initial_tp=2: SGLang's start-up capture runs under the base layout's group. With 4 GPUs the base
  (2 x TP2) differs from SGLang's WORLD TP4: graphs captured under the WORLD group would hang or sum the two replicas
  on replay; greedy outputs of both replicas must equal a stock TP2 engine's. With 2 GPUs the base is the WORLD
  (still a check that graphs on a TP2 base replay right).
- a killed rank inside a TP2 layout: the driver names the dead rank, asks every rank to abort its communicators
  (`layout_comm`), and the surviving rank, blocked in the decode's all-reduce with the dead one, returns with an error
  and exits in bounded time instead of hanging.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

pytest.importorskip("sglang.srt")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

MODEL = os.environ.get("PAT_SGLANG_GPU_MODEL")
DTYPE = os.environ.get("PAT_SGLANG_GPU_DTYPE", "float32")
EXACT = int(os.environ.get("PAT_SGLANG_GPU_EXACT_TOKENS", 32))

if not torch.cuda.is_available():
    pytest.skip(f"needs CUDA: torch {torch.__version__} in {sys.prefix} sees no CUDA device", allow_module_level=True)
if not MODEL:
    pytest.skip("set PAT_SGLANG_GPU_MODEL to a local HF checkpoint (Llama or Qwen3)", allow_module_level=True)

from pat_rollout.types import Request, SamplingParams  # noqa: E402

PROMPTS = [(1, 450, 4996, 17354, 1701), (1, 3439, 17615, 11, 4683, 338), (1, 1128, 1784), (1, 306, 763, 304)]


def _requests(max_new: int, tag: str) -> list[Request]:
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=p, sampling=sp) for i, p in enumerate(PROMPTS)]


def _pool(num_devices: int, initial_tp: int, tps: tuple[int, ...]):
    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.layout import Layout
    from pat_rollout.sglang.pool import SglPool, check_model

    cfg = PatRolloutConfig(model_path=MODEL, num_devices=num_devices, backend="sglang", initial_tp=initial_tp,
                           candidate_tps=tps, policy="manual", dtype=DTYPE,
                           engine_args={"disable_cuda_graph": False, "mem_fraction_static": 0.5})
    return SglPool(cfg, check_model(cfg), Layout.uniform(num_devices, initial_tp), device="cuda")


def test_graphs_on_with_a_tp2_base_equal_a_stock_tp2_engine():
    n = 4 if torch.cuda.device_count() >= 4 else 2
    if torch.cuda.device_count() < 2:
        pytest.skip("a TP2 base needs 2 GPUs (4 to differ from the WORLD's TP)")
    from pat_rollout.sglang.engine import SGLangEngine

    stock = SGLangEngine(MODEL, tp_size=2, device="cuda", dtype=DTYPE, mem_fraction_static=0.3)
    try:
        stock.add_requests(_requests(64, "s"))
        ref = {o.request_id[1:]: list(o.token_ids) for o in stock.run_to_completion(timeout=600)}
    finally:
        stock.shutdown()
    pool = _pool(n, 2, (2, 4) if n == 4 else (2,))
    try:
        print(f"pat/comm_bytes_per_gpu={pool.startup.comm_bytes_per_gpu} capture_s={pool.startup.capture_s}")
        info = pool.info()
        assert all(i["graphs"]["current"]["type"] != "NoneType" for i in info)  # SGLang captured at start-up
        per_replica = {r: _requests(64, f"r{r}-") for r in range(n // 2)}
        pool.add_requests(per_replica)
        outs = {o.request_id: list(o.token_ids) for o in pool.client.run_to_completion(timeout=600)}
        for r in per_replica:
            for i in range(len(PROMPTS)):
                assert outs[f"r{r}-{i}"][:EXACT] == ref[str(i)][:EXACT], (r, i)
        if n == 4:  # and the WORLD-sized layout captured at start-up replays too
            pool.reconfigure(4, {})
            pool.add_requests({0: _requests(64, "w")})
            outs = {o.request_id: list(o.token_ids) for o in pool.client.run_to_completion(timeout=600)}
            for i in range(len(PROMPTS)):
                assert outs[f"w{i}"][:EXACT] == ref[str(i)][:EXACT], i
    finally:
        pool.shutdown()


def test_a_killed_rank_inside_a_tp2_layout_releases_its_peer():
    if torch.cuda.device_count() < 2:
        pytest.skip("a TP2 layout needs 2 GPUs")
    from pat_rollout.driver.errors import WorkerError
    from pat_rollout.sglang import layout_comm
    from pat_rollout.sglang.rank_rpc import is_gone

    pool = _pool(2, 1, (1, 2))
    try:
        pool.reconfigure(2, {})
        pool.add_requests({0: _requests(4096, "k")})
        pool.step([0], 8)
        os.kill(pool.pids[1], signal.SIGKILL)  # rank 1 dies; rank 0 sits in (or reaches) a decode all-reduce with it
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank\(s\) \[1\]"):
            for _ in range(1000):
                pool.step([0], 8)
        assert os.path.exists(layout_comm.abort_path(pool.workdir, None))  # every rank was asked to abort
        while not is_gone(pool.pids[0]):  # rank 0's blocked collective failed and its scheduler exited
            assert time.monotonic() - t0 < pool.config.rpc_deadline_s() + 120, "rank 0 still blocked"
            time.sleep(0.5)
    finally:
        pool.shutdown()
