"""GPU check of the SGLang backend on a real model: greedy tokens equal HF transformers; with 2 GPUs, the PAT
driver on an SglPool switches 2 x TP=1 -> 1 x TP=2 -> 2 x TP=1 -> 1 x TP=2 -> 2 x TP=1 mid-decode (KV migration or
recomputation; eager, and with decode CUDA graphs per layout) and its outputs equal an unswitched run.

Skipped without CUDA or sglang. Set PAT_SGLANG_GPU_MODEL to a local HF checkpoint (Llama or Qwen3), e.g.
  PAT_SGLANG_GPU_MODEL=/models/Qwen3-0.6B python -m pytest tests/gpu/test_sglang_gpu.py -q
Runs in float32 so that greedy ties between SGLang's and HF's kernels are rare; PAT_SGLANG_GPU_DTYPE overrides
(with bf16 expect token divergence after near-ties: the test then only compares the first
PAT_SGLANG_GPU_EXACT_TOKENS tokens, default all). The TP=2 switch needs 2 GPUs.

Start-up graphs, communicators and the NCCL abort (docs/gpu_graphs_and_faults.md), each test saying its GPUs:
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

# "sglang.srt": a bare "sglang" could resolve to a namespace package of a same-named folder on sys.path.
pytest.importorskip("sglang.srt")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]

MODEL = os.environ.get("PAT_SGLANG_GPU_MODEL")
DTYPE = os.environ.get("PAT_SGLANG_GPU_DTYPE", "float32")
MAX_NEW = 32
EXACT = int(os.environ.get("PAT_SGLANG_GPU_EXACT_TOKENS", MAX_NEW))

if not torch.cuda.is_available():
    pytest.skip(f"needs CUDA: torch {torch.__version__} in {sys.prefix} sees no CUDA device", allow_module_level=True)
if not MODEL:
    pytest.skip("set PAT_SGLANG_GPU_MODEL to a local HF checkpoint (Llama or Qwen3)", allow_module_level=True)

from pat_rollout.types import Request, SamplingParams  # noqa: E402

PROMPTS = [(1, 450, 4996, 17354, 1701), (1, 3439, 17615, 11, 4683, 338), (1, 1128, 1784)]


def _requests(max_new):
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [Request(request_id=f"g{i}", prompt_token_ids=p, sampling=sp) for i, p in enumerate(PROMPTS)]


def _hf_greedy(prompt, max_new):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=getattr(torch, DTYPE)).cuda().eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    del model
    torch.cuda.empty_cache()
    return out[0, len(prompt):].tolist()


def test_sglang_gpu_equals_hf_and_switch():
    from pat_rollout.sglang.engine import SGLangEngine

    a = SGLangEngine(MODEL, tp_size=1, device="cuda", dtype=DTYPE, mem_fraction_static=0.3)
    try:
        a.add_requests(_requests(MAX_NEW))
        ref = {o.request_id: o for o in a.run_to_completion()}
        for i, p in enumerate(PROMPTS):
            assert list(ref[f"g{i}"].token_ids[:EXACT]) == _hf_greedy(list(p), MAX_NEW)[:EXACT]
        if torch.cuda.device_count() < 2:
            return
        c = SGLangEngine(MODEL, tp_size=2, device="cuda", dtype=DTYPE, mem_fraction_static=0.3, base_gpu_id=0)
        try:
            done = {}
            a.add_requests(_requests(MAX_NEW))
            done.update({o.request_id: o for o in a.step(4).finished})
            c.import_requests(a.export_requests())
            done.update({o.request_id: o for o in c.run_to_completion()})
            for rid, o in ref.items():
                assert done[rid].token_ids[:EXACT] == o.token_ids[:EXACT], rid
        finally:
            c.shutdown()
    finally:
        a.shutdown()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs-per-layout"])
@pytest.mark.parametrize("handoff", ["migrate", "recompute"])
def test_sglang_pool_gpu_switch_equals_unswitched(handoff, graphs):
    """Grow, shrink, grow again and shrink: with decode CUDA graphs on, every layout is captured at start-up and
    replays its own graphs on re-entry (`layout_graphs`)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("the pool switch needs 2 GPUs")
    import time

    from pat_rollout.config import PatRolloutConfig
    from pat_rollout.driver import RolloutDriver
    from pat_rollout.sglang.engine import SGLangEngine

    max_new = 256
    a = SGLangEngine(MODEL, tp_size=1, device="cuda", dtype=DTYPE, mem_fraction_static=0.3)
    try:
        a.add_requests(_requests(max_new))
        ref = {o.request_id: o for o in a.run_to_completion()}
    finally:
        a.shutdown()
    cfg = PatRolloutConfig(model_path=MODEL, num_devices=2, backend="sglang", initial_tp=1, candidate_tps=(1, 2),
                           policy="manual", kv_handoff=handoff, dtype=DTYPE, steps_per_poll=4,
                           engine_args={"disable_cuda_graph": not graphs})
    driver = RolloutDriver(cfg)
    try:
        futures = {r.request_id: driver.submit(r) for r in _requests(max_new)}
        for tp, n in ((2, 16), (1, 64), (2, 128), (1, 192)):
            while not all(rid in driver._progress and driver._progress[rid].num_output_tokens >= n for rid in futures):
                time.sleep(0.005)
            driver.reconfigure(tp)
        outs = {rid: f.result(timeout=600) for rid, f in futures.items()}
        for rid, o in ref.items():
            assert outs[rid].token_ids[:EXACT] == o.token_ids[:EXACT], rid
    finally:
        driver.shutdown()


def _tagged_requests(max_new: int, tag: str) -> list[Request]:
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", prompt_token_ids=p, sampling=sp) for i, p in enumerate(PROMPTS)]


def _graph_pool(num_devices: int, initial_tp: int, tps: tuple[int, ...]):
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
        stock.add_requests(_tagged_requests(64, "s"))
        ref = {o.request_id[1:]: list(o.token_ids) for o in stock.run_to_completion(timeout=600)}
    finally:
        stock.shutdown()
    pool = _graph_pool(n, 2, (2, 4) if n == 4 else (2,))
    try:
        print(f"pat/comm_bytes_per_gpu={pool.startup.comm_bytes_per_gpu} capture_s={pool.startup.capture_s}")
        info = pool.info()
        assert all(i["graphs"]["current"]["type"] != "NoneType" for i in info)  # SGLang captured at start-up
        per_replica = {r: _tagged_requests(64, f"r{r}-") for r in range(n // 2)}
        pool.add_requests(per_replica)
        outs = {o.request_id: list(o.token_ids) for o in pool.client.run_to_completion(timeout=600)}
        for r in per_replica:
            for i in range(len(PROMPTS)):
                assert outs[f"r{r}-{i}"][:EXACT] == ref[str(i)][:EXACT], (r, i)
        if n == 4:  # and the WORLD-sized layout captured at start-up replays too
            pool.reconfigure(4, {})
            pool.add_requests({0: _tagged_requests(64, "w")})
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

    pool = _graph_pool(2, 1, (1, 2))
    try:
        pool.reconfigure(2, {})
        pool.add_requests({0: _tagged_requests(4096, "k")})
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
