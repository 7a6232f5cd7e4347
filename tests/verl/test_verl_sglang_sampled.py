"""verl's agent loop on an SGLang pool, sampling at temperature 1 (verl's rollout default), with the planner
switching 2 x TP1 -> 1 x TP2 mid-stage (each stage starts back in 2 x TP1): every TP2 batch sampled the same
ids on both ranks of the replica (pool_switch._reseed), and every stage completes within a deadline.

The driver inside verl's PatServer actor is built by `RecordingDriver`, which sets PAT_SGLANG_SAMPLED_LOG in the
actor before the pool spawns its scheduler processes; the test reads the per-rank logs from that directory.
Runs where verl and SGLang are both installed (`make test-verl-sglang`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("fastapi")
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang.srt") is None:
    pytest.skip("SGLang is not installed in this environment (make install-verl-sglang)", allow_module_level=True)

from verl_helpers import compose_ppo, pat_server_manager  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.ray, pytest.mark.slow, pytest.mark.sglang]

PROMPT_LEN, RESPONSE_LEN = 64, 24


class RecordingDriver:
    """Driver factory run inside the PatServer actor: the real RolloutDriver, with every SGLang rank logging the
    ids it samples into `log_dir` (the scheduler processes inherit the actor's environment)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir

    def __call__(self, config):
        from pat_rollout.driver import RolloutDriver
        from pat_rollout.sglang.debug_hooks import LOG_ENV

        os.environ[LOG_ENV] = self.log_dir
        return RolloutDriver(config)


def _tp2_always_wins(path) -> str:
    """A profile in which one TP2 replica beats two TP1 replicas at every batch size and switching is free."""
    from profile_helpers import write_profile

    write_profile(path)
    profile = json.loads(path.read_text())
    for row in profile["decode"]:
        row["step_s"] = 0.002 * row["batch"] if row["tp"] == 2 else 0.02 * row["batch"]
    path.write_text(json.dumps(profile))
    return str(path)


@pytest.fixture(scope="module")
def sampled_stack(ray_cluster, tiny_llama_with_tokenizer, tmp_path_factory):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    log_dir = tmp_path_factory.mktemp("sampled_log")
    profile = _tp2_always_wins(tmp_path_factory.mktemp("profile") / "tp2_wins.json")
    pat = "+actor_rollout_ref.rollout.engine_kwargs.pat"
    cfg = compose_ppo([
        "actor_rollout_ref.rollout.name=pat",
        f"actor_rollout_ref.model.path={tiny_llama_with_tokenizer}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.temperature=1.0",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"{pat}.backend=sglang", f"{pat}.policy=pat", f"{pat}.initial_tp=1", f"{pat}.candidate_tps=[1,2]",
        f"{pat}.dtype=float32", f"{pat}.steps_per_poll=2", f"{pat}.profile_path={profile}",
        f"{pat}.planner.eval_every_steps=2", f"{pat}.planner.min_steps_between_switches=2",
        f"{pat}.planner.min_gain_s=0.0", f"{pat}.planner.min_gain_ratio=0.0", f"{pat}.planner.start_layout=false",
        f"{pat}.planner.calibrate=false",
    ])
    with pat_server_manager(cfg, RecordingDriver(str(log_dir)), 2, "pat_test_sampled") as manager:
        yield cfg, manager, str(log_dir)


@pytest.mark.timeout(900)
def test_agent_loop_sampling_across_switches_ranks_agree(sampled_stack):
    import numpy as np
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from pat_rollout.sglang.debug_hooks import read_sampled_logs, replica_mismatches

    cfg, manager, log_dir = sampled_stack
    assert cfg.actor_rollout_ref.rollout.temperature == 1.0
    worker = AgentLoopWorker(cfg, manager.get_client())
    # 5 prompts: 3 on one TP1 replica, 2 on the other, so the two ranks draw different amounts of randomness
    # before the switch (equal batches would leave their RNG states equal, and the test could not fail)
    texts = ("What is 1 + 2?", "Solve 3x + 5 = 20.", "Find x.", "Name a prime.", "2 * 21 = ?")
    prompts = [[{"role": "user", "content": t}] for t in texts]
    for stage in range(2):  # the second stage starts back in 2 x TP1 and switches again
        batch = DataProto.from_dict(non_tensors={"raw_prompt": np.array(prompts, dtype=object),
                                                 "index": np.arange(len(prompts))})
        out = asyncio.run(asyncio.wait_for(worker.generate_sequences(batch), timeout=300))
        b = out.batch
        assert b["responses"].shape == (len(prompts), RESPONSE_LEN)
        mask = b["response_mask"].bool()
        assert (mask.sum(-1) >= 1).all() and (b["rollout_log_probs"][mask] <= 0).all()
        metrics = asyncio.run(asyncio.wait_for(manager.get_replicas()[0].get_metrics(), timeout=60))
        print(f"stage {stage}: {metrics.get('pat/layouts')}, {metrics.get('pat/num_reconfigs')} switches")

    logs = read_sampled_logs(log_dir)
    assert sorted(logs) == [0, 1]
    compared, bad = replica_mismatches(logs, tp=2)
    assert compared >= 4, f"only {compared} TP2 batches logged"
    assert not bad, "ranks of the TP2 replica sampled different tokens:\n" + "\n".join(bad[:10])
    switches = {line["switches"] for lines in logs.values() for line in lines if line["tp"] == 2}
    assert len(switches) >= 2, switches  # a TP2 phase in each stage, each after its own reseed
