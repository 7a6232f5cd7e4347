"""The vLLM backend's pure parts, without vLLM: registry entry, device placement, seeds, the missing-vLLM error.
Runs in every venv (`make test` collects it too)."""

from __future__ import annotations

import importlib.util

import pytest

from pat_rollout.config import PatRolloutConfig
from pat_rollout.driver.backends import get_backend
from pat_rollout.vllm.pool import cpu_bind, replica_env, replica_seed


def test_registered_behind_the_backend_registry():
    backend = get_backend("vllm")
    assert backend.__name__ == "pat_rollout.vllm.backend" and callable(backend.build_pool)
    assert PatRolloutConfig(model_path="m", num_devices=2, backend="vllm").backend == "vllm"


def test_cpu_bind_gives_each_device_its_share_of_the_cores():
    assert cpu_bind([0, 1], 2, cpus=[0, 1]) == "0|1"  # 1 x TP2 on 2 cores
    assert [cpu_bind([d], 2, cpus=[0, 1]) for d in (0, 1)] == ["0", "1"]  # 2 x TP1
    assert cpu_bind([0, 1], 2, cpus=[0, 1, 2, 3, 4, 5]) == "0,1,2|3,4,5"
    assert cpu_bind([2, 3], 4, cpus=[4, 5, 6, 7, 8, 9, 10, 11]) == "8,9|10,11"  # devices 2, 3 of 4
    assert cpu_bind([0, 1, 2, 3], 4, cpus=[0, 1]) == "0|1|0|1"  # fewer cores than devices: wraps


def test_replica_env_places_by_devices():
    gpu = replica_env((2, 3), 4, "cuda")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_CPU_OMP_THREADS_BIND" not in gpu
    cpu = replica_env((1,), 2, "cpu")
    assert "CUDA_VISIBLE_DEVICES" not in cpu and cpu["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 0
    assert cpu["VLLM_WORKER_MULTIPROC_METHOD"] == gpu["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_replica_seeds_differ_across_replicas_and_switches():
    seeds = {replica_seed(7, s, r) for s in range(50) for r in range(8)}
    assert len(seeds) == 400 and all(0 <= x < 2**31 - 1 for x in seeds)
    assert replica_seed(7, 3, 1) == replica_seed(7, 3, 1) != replica_seed(8, 3, 1)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_model_spec_without_vllm_names_the_install_target(tiny_models):
    config = PatRolloutConfig(model_path=tiny_models["llama"], num_devices=2, backend="vllm")
    with pytest.raises(RuntimeError, match="make install-vllm"):
        get_backend("vllm").model_spec(config)


def test_engine_args_take_the_config_then_the_overrides(tiny_models):
    import json
    from pathlib import Path

    from pat_rollout.types import ModelSpec
    from pat_rollout.vllm.pool import engine_args

    spec = ModelSpec.from_hf_config(json.loads((Path(tiny_models["llama"]) / "config.json").read_text()))
    config = PatRolloutConfig(model_path=tiny_models["llama"], num_devices=2, backend="vllm", max_num_seqs=8,
                              engine_args={"gpu_memory_utilization": 0.5, "max_model_len": 256})
    kw = engine_args(config, spec, max_model_len=128)
    assert kw["gpu_memory_utilization"] == 0.5 and kw["max_model_len"] == 128 and kw["max_num_seqs"] == 8
    assert kw["model"] == tiny_models["llama"] and kw["skip_tokenizer_init"] and kw["enforce_eager"]
    assert kw["worker_extension_cls"] == "pat_rollout.vllm.worker_ext.PatWorkerExtension"
    assert kw["kv_transfer_config"] == {"kv_connector": "PatKVConnector", "kv_role": "kv_consumer",
                                        "kv_connector_module_path": "pat_rollout.vllm.kv_connector"}
    with pytest.raises(ValueError, match="apply to backend='sglang' or 'vllm' only"):
        PatRolloutConfig(model_path="m", num_devices=2, engine_args={"x": 1})



class _FakeReplica:
    """Stands in for `replica.VllmReplica` (no vLLM): holds requests, and an engine that a shutdown drops."""

    started: list[tuple[int, tuple[int, ...]]] = []

    def __init__(self, index, devices, args, env, eos_token_ids=()):
        self.index, self.devices, self.engine, self.tracked = index, tuple(devices), object(), {}
        self.kv_tokens, self.block_size, self.num_blocks = 1024, 16, 64
        self.cached_tokens = {}
        _FakeReplica.started.append((index, self.devices))

    def resume(self, t, kv=None):
        assert kv is None  # kv_handoff="auto" without a cost model: nothing migrates
        self.tracked[t.request.request_id] = t

    def export(self, request_ids=None):
        return [self.tracked.pop(r) for r in list(self.tracked)]

    def shutdown(self):
        self.tracked.clear()
        self.engine = None


@pytest.fixture
def fake_pool(monkeypatch):
    """A VllmPool over `_FakeReplica`s in 2 x TP1 with requests a, c on replica 0 and b on replica 1."""
    import sys
    import types

    from pat_rollout.layout import Layout
    from pat_rollout.types import Request, SamplingParams
    from pat_rollout.vllm import pool as vpool
    from pat_rollout.vllm.replica import Tracked

    fake = types.ModuleType("pat_rollout.vllm.replica")
    fake.VllmReplica = _FakeReplica
    monkeypatch.setitem(sys.modules, "pat_rollout.vllm.replica", fake)
    _FakeReplica.started = []
    p = object.__new__(vpool.VllmPool)
    p.config = PatRolloutConfig(model_path="m", num_devices=2, backend="vllm", candidate_tps=(1, 2))
    p.spec = types.SimpleNamespace(eos_token_ids=(), check_tp=lambda tp: None)
    p.num_devices, p.device, p.args = 2, "cpu", {"seed": 1, "model": "m"}
    p.base = p.layout = Layout.uniform(2, 1)
    p.switches, p.fault, p.pending, p.weights_dir, p.cost, p.held = 0, None, {}, None, None, []
    p.replicas = p._start(p.base)
    sp = SamplingParams(max_new_tokens=8)
    for rid, r in (("a", 0), ("b", 1), ("c", 0)):
        p.replicas[r].resume(Tracked(request=Request(request_id=rid, prompt_token_ids=(1, 2), sampling=sp),
                                     prefix_ids=(5,), prefix_lps=(-0.5,)))
    return p


# per phase: engines of 2 x TP1 restarted by the rollback, requests exported before the fault (resubmitted)
ROLLBACKS = {"export": (0, 2), "stop": (1, 3), "start": (2, 3), "import": (2, 3)}


@pytest.mark.parametrize("phase", list(ROLLBACKS))
def test_a_fault_in_each_switch_phase_rolls_back_to_the_old_layout(fake_pool, phase):
    """The rollback logic alone (the real-engine version: test_vllm_pool_switch.py): back to 2 x TP1, only the
    stopped engines restarted, each request on its replica with its tokens so far, the error naming all that."""
    from pat_rollout.driver.errors import ReconfigurationError
    from pat_rollout.layout import Layout

    p = fake_pool
    old = list(p.replicas)
    restarted, exported = ROLLBACKS[phase]
    p.fail_next(phase)
    with pytest.raises(ReconfigurationError, match=rf"failed in phase {phase} \(RuntimeError\(\"injected failure in "
                                                   rf"VllmPool switch phase '{phase}'.*rolled back to the old layout "
                                                   rf"2xTP1.*\({restarted} engines restarted\), {exported} of 3 "):
        p.reconfigure(2, {"a": 0, "b": 1, "c": 0})
    assert p.layout == Layout.uniform(2, 1) and p.fault is None
    assert [rep is o for rep, o in zip(p.replicas, old)].count(False) == restarted
    assert {rid: rep.index for rep in p.replicas for rid in rep.tracked} == {"a": 0, "b": 1, "c": 0}
    assert all(t.token_ids == (5,) and t.log_probs == (-0.5,) for rep in p.replicas for t in rep.tracked.values())
    assert all(rep.engine is not None for rep in p.replicas)
    res = p.reconfigure(2, {"a": 0, "b": 1, "c": 0})  # the next switch goes through
    assert p.layout == Layout.uniform(2, 2) and res.assignment == {"a": 0, "b": 0, "c": 0}
    assert sorted(res.recomputed) == ["a", "b", "c"] and list(res.phase_s) == ["export", "stop", "start", "import", "kv_import"]


def test_fail_next_rejects_an_unknown_phase(fake_pool):
    with pytest.raises(ValueError, match="unknown switch phase 'reshard'"):
        fake_pool.fail_next("reshard")


def test_kv_manifest_gives_each_new_rank_its_heads():
    """kv.plan_kv's head mapping as the connector reads it: TP1 -> TP2 each new rank takes its head of the one
    old file; TP2 -> TP1 the rank takes head 0 of rank 0's file and head 0 of rank 1's into its heads 0 and 1."""
    from pat_rollout.vllm.pool import kv_manifest

    one = {"path": "x.rank0", "shape": [1, 2, 128, 64], "dtype": "float32", "tokens": 14, "layers": 2, "bytes": 2 * 65536}
    m = kv_manifest("a", [one], (0,), (0, 1), num_kv_heads=2)
    assert m["tokens"] == 14 and m["layers"] == 2 and m["bytes"] == 2 * 65536
    assert [[(f["path"], f["src"], f["dst"]) for f in r] for r in m["ranks"]] == [[("x.rank0", [0, 1], 0)],
                                                                              [("x.rank0", [1, 2], 0)]]
    halves = [{**one, "path": f"y.rank{k}", "shape": [1, 1, 128, 64], "bytes": 65536} for k in range(2)]
    m = kv_manifest("a", halves, (0, 1), (1,), num_kv_heads=2)
    assert [[(f["path"], f["src"], f["dst"]) for f in r] for r in m["ranks"]] == [[("y.rank0", [0, 1], 0),
                                                                               ("y.rank1", [0, 1], 1)]]
    assert m["bytes"] == 2 * 65536
    with pytest.raises(RuntimeError, match="different token counts"):
        kv_manifest("a", [halves[0], {**halves[1], "tokens": 13}], (0, 1), (0,), num_kv_heads=2)


class _QueuedEngine:
    """Stands in for vLLM's LLMEngine: `step` reads one queued engine-core output (a list of request outputs),
    as `LLMEngine.step` reads one `EngineCoreOutputs` from its client's queue."""

    def __init__(self, batches):
        import queue
        import types

        self.engine_core = types.SimpleNamespace(outputs_queue=queue.Queue())
        proc = types.SimpleNamespace(is_alive=lambda: True, pid=1, exitcode=None)
        self.engine_core.resources = types.SimpleNamespace(engine_manager=types.SimpleNamespace(processes=[proc]))
        for b in batches:
            self.engine_core.outputs_queue.put(b)

    def step(self):
        return self.engine_core.outputs_queue.get_nowait()


def _out(rid, ids, finished=False):
    import types

    c = types.SimpleNamespace(token_ids=list(ids), logprobs=[{t: types.SimpleNamespace(logprob=-1.0)} for t in ids],
                              finish_reason="length" if finished else None)
    return types.SimpleNamespace(request_id=rid, outputs=[c], num_cached_tokens=0, finished=finished)


def test_replica_step_skips_outputs_of_aborted_requests():
    """The engine core runs ahead of the pool: after an abort its queue still holds outputs of the aborted request
    (`old`). Those are not steps: two steps of the new request read its first two tokens, whatever the backlog;
    an empty queue then misses the deadline (bounded), naming the replica."""
    from pat_rollout.types import Request, SamplingParams
    from pat_rollout.vllm.replica import EngineTimeout, Tracked, VllmReplica

    rep = object.__new__(VllmReplica)
    rep.index, rep.devices, rep.cached_tokens = 1, (1,), {}
    req = Request(request_id="new", prompt_token_ids=(1, 2), sampling=SamplingParams(max_new_tokens=3))
    rep.tracked = {"new": Tracked(request=req)}
    backlog = [[_out("old", range(n))] for n in range(1, 6)]
    rep.engine = _QueuedEngine(backlog[:3] + [[_out("old", [0] * 4), _out("new", [7])]] + backlog[3:]
                               + [[_out("new", [8])]])  # DELTA outputs: the new tokens only
    finished, decoded = rep.step(2, deadline_s=1.0)
    assert (finished, decoded) == ([], 2) and rep.tracked["new"].token_ids == (7, 8)
    assert rep.engine.engine_core.outputs_queue.empty()
    with pytest.raises(EngineTimeout, match="replica 1 on devices \\[1\\]: no engine-core output within 0.1 s"):
        rep.step(1, deadline_s=0.1)


def test_stop_all_stops_every_engine_at_once_and_reports_failures():
    """`pool.stop_all` runs the stops side by side: each fake stop waits on a barrier of all of them, which only
    concurrent stops pass (one after another, the first would wait out the barrier's timeout and fail); a stop
    that raises is reported with its replica, and the others still stop."""
    import threading
    import types

    from pat_rollout.vllm.pool import stop_all

    barrier = threading.Barrier(3, timeout=10)
    stopped = []

    def replica(i, fail=False):
        def shutdown():
            barrier.wait()
            if fail:
                raise RuntimeError(f"replica {i} would not stop")
            stopped.append(i)
        return types.SimpleNamespace(index=i, shutdown=shutdown)

    errors = stop_all([replica(0), replica(1, fail=True), replica(2)])
    assert sorted(stopped) == [0, 2]
    assert [(i, str(e)) for i, e in errors] == [(1, "replica 1 would not stop")]
    assert stop_all([]) == []
