"""PAT's per-stage metrics reach verl's trainer metrics through `PatAgentLoopManager` (see pat_rollout/verl/agent_loop.py).

End to end on CPU through verl's own classes: LLMServerManager builds 2 PatReplicas (fake driver), verl's
AgentLoopManager machinery (Ray AgentLoopWorker actors, single-turn agent loop, load balancer) generates, and
`PatAgentLoopManager.generate_sequences` returns the DataProto with the pool-reduced `pat/*` metrics in
`meta_info["timing"]`. The test then replays what verl 0.9.1's legacy `RayPPOTrainer.fit` does with it
(`timing_raw.update(meta_info["timing"])` -> `compute_timing_metrics` -> `Tracking.log`) and checks the keys survive.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("fastapi")
from verl_helpers import compose_ppo, pat_server_manager  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FQN = "pat_rollout.verl.agent_loop.PatAgentLoopManager"
SAMPLER = {"path": "pkg://pat_rollout.verl.replay_buffer", "name": "PatReplayBuffer"}  # v1 trainer's PAT metrics
PROMPT_LEN, RESPONSE_LEN, TP, NUM_WORKERS = 64, 8, 2, 4  # 4 dummy trainer "GPUs" -> 2 PAT pools of 2


def test_reduce_pat_metrics_mean_max_and_drops_strings():
    from pat_rollout.verl.replica import reduce_pat_metrics

    out = reduce_pat_metrics([
        {"pat/gen_time_s": 2.0, "pat/num_reconfigs": 1, "pat/layouts": "1x8->2x4", "pat/replica_rank": 0.0},
        {"pat/gen_time_s": 4.0, "pat/num_reconfigs": 3, "pat/layouts": "1x8", "pat/replica_rank": 1.0,
         "pat/reconfig_kv_s": 0.5},
    ])
    assert out == {"pat/gen_time_s": 3.0, "pat/gen_time_s/max": 4.0, "pat/num_reconfigs": 2.0,
                   "pat/num_reconfigs/max": 3.0, "pat/reconfig_kv_s": 0.5, "pat/reconfig_kv_s/max": 0.5}


@pytest.mark.verl
def test_recipes_and_plugin_yaml_select_the_manager(tmp_path):
    import pat_rollout.verl as pv

    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_V1"} | {"PRINT_OVERRIDES": "1",
                                                                          "DATA_DIR": str(tmp_path)}
    for script in sorted((REPO / "recipes" / "deepscaler").glob("run_*.sh")):
        overrides = subprocess.run(["bash", str(script)], env=env,
                                   capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
        cfg = compose_ppo(overrides)
        assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == FQN, script.name
        assert cfg.trainer.use_v1 is False, script.name
        assert dict(cfg.trainer.v1.sampler.custom_sampler) == SAMPLER, script.name  # for VERL_USE_V1=true
    cfg = compose_ppo([], config_dir=str(Path(pv.__file__).parent / "config"), config_name="pat_ppo")
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == FQN
    assert dict(cfg.trainer.v1.sampler.custom_sampler) == SAMPLER
    from verl.utils.config import omega_conf_to_dataclass

    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).agent.agent_loop_manager_class == FQN


@pytest.mark.verl
def test_v1_trainer_gets_verls_tq_manager():
    """Under the v1 TaskRunner (transfer_queue.enable=True) the FQN must still yield a working manager."""
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs transfer_queue (not installed)")
    from unittest import mock

    from verl.trainer.ppo.v1 import AgentLoopManagerTQ

    from pat_rollout.verl.agent_loop import PatAgentLoopManager

    cfg = compose_ppo(["actor_rollout_ref.rollout.name=pat", "transfer_queue.enable=True"])
    with mock.patch.object(AgentLoopManagerTQ, "create", return_value="tq") as create:
        assert PatAgentLoopManager.create(config=cfg, llm_client=None) == "tq"
    create.assert_called_once()


@pytest.fixture(scope="module")
def pat_stack(ray_cluster, tiny_llama_with_tokenizer):
    import fake_driver
    import ray

    ray.cloudpickle.register_pickle_by_value(fake_driver)
    cfg = compose_ppo([
        "actor_rollout_ref.rollout.name=pat",
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={FQN}",
        f"actor_rollout_ref.model.path={tiny_llama_with_tokenizer}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={TP}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        "trainer.n_gpus_per_node=4",
        "trainer.use_v1=False",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=1",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.candidate_tps=[1,2]",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.dtype=float32",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.profile_path=h100_llama31_8b",
    ])

    with pat_server_manager(cfg, fake_driver.FakeRolloutDriver, NUM_WORKERS, "pat_metrics_test") as manager:
        yield cfg, manager


@pytest.mark.verl
@pytest.mark.ray
@pytest.mark.slow
def test_generate_sequences_carries_pat_metrics_to_trainer_metrics(pat_stack):
    import numpy as np
    import ray
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_timing_metrics
    from verl.utils.import_utils import load_class_from_fqn
    from verl.utils.tracking import Tracking

    from pat_rollout.verl.replica import collect_pat_metrics

    cfg, server_manager = pat_stack
    # as verl's RayPPOTrainer._init_async_rollout_manager does
    manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    manager = manager_cls.create(config=cfg, llm_client=server_manager.get_client(), teacher_client=None,
                                 reward_loop_worker_handles=None)
    assert type(manager).__name__ == "PatAgentLoopManager"
    try:
        prompts = [[{"role": "user", "content": t}] for t in ("What is 1 + 2?", "Solve 3x + 5 = 20.",
                                                                "Find x.", "2 * 7 = ?")]
        batch = DataProto.from_dict(non_tensors={"raw_prompt": np.array(prompts, dtype=object),
                                                 "index": np.arange(len(prompts))})
        batch = batch.repeat(cfg.actor_rollout_ref.rollout.n, interleave=True)  # as the trainer does
        batch.meta_info["global_steps"] = 1
        out = manager.generate_sequences(batch)
        direct = asyncio.run(collect_pat_metrics(server_manager.get_replicas()))
    finally:
        for w in manager.agent_loop_workers:
            ray.kill(w)

    n = len(batch)
    timing = out.meta_info["timing"]
    print("meta_info['timing'] pat/* keys:", {k: v for k, v in timing.items() if k.startswith("pat/")})
    assert "agent_loop/generate_sequences/mean" in timing  # verl's own entries are kept
    # values = the per-pool stage metrics of the 2 pools, mean as pat/<k>, max as pat/<k>/max
    pat = {k: v for k, v in timing.items() if k.startswith("pat/")}
    assert set(pat) == set(direct) and "pat/layouts" not in pat
    for key in ("pat/num_requests", "pat/num_requests/max", "pat/response_length/max", "pat/num_reconfigs"):
        assert pat[key] == direct[key], key
    assert pat["pat/num_requests"] * 2 == n  # both pools served, mean over 2 pools
    resp_len = out.batch["attention_mask"][:, PROMPT_LEN:].sum(-1)
    assert pat["pat/response_length/max/max"] == float(resp_len.max())
    assert 0 < pat["pat/gen_time_s"] <= pat["pat/gen_time_s/max"] <= direct["pat/gen_time_s/max"]

    # what verl 0.9.1's RayPPOTrainer.fit does with the generation output (ray_trainer.py, "gen" section and
    # "collect metrics"): timing_raw.update(meta_info["timing"]); pop; metrics.update(compute_timing_metrics(...))
    timing_raw = {"gen": 1.0, "step": 2.0}
    timing_raw.update(out.meta_info["timing"])
    out.meta_info.pop("timing", None)
    metrics = {}
    metrics.update(compute_timing_metrics(batch=out, timing_raw=timing_raw))
    for key, value in pat.items():
        assert metrics[f"timing_s/{key}"] == value
    print("trainer metrics, pat part:", {k: v for k, v in metrics.items() if "/pat/" in k})
    Tracking(project_name="pat_test", experiment_name="metrics", default_backend=["console"]).log(
        data=metrics, step=1)
