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
    with pytest.raises(ValueError, match="apply to backend='sglang' or 'vllm' only"):
        PatRolloutConfig(model_path="m", num_devices=2, engine_args={"x": 1})
