"""Hydra composes verl's config with rollout.name=pat; from_verl turns it into a PatRolloutConfig."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
from verl_helpers import compose_ppo  # noqa: E402

from pat_rollout.config import PatRolloutConfig  # noqa: E402
from pat_rollout.verl.config import ALLOWED_KEYS, from_verl  # noqa: E402

pytestmark = pytest.mark.verl


def rollout_config(*overrides: str):
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_ppo(["actor_rollout_ref.rollout.name=pat", *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)


def test_compose_engine_kwargs_gives_rollout_config_and_pat_config(tiny_models):
    from verl.workers.config import RolloutConfig

    rc = rollout_config(
        "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=1",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.candidate_tps=[1,2,4]",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.kv_handoff=migrate",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.dtype=float32",
        "+actor_rollout_ref.rollout.engine_kwargs.pat.planner.min_batch_per_replica=4",
        "+actor_rollout_ref.rollout.custom.pat.steps_per_poll=4",
    )
    assert isinstance(rc, RolloutConfig) and rc.name == "pat" and rc.mode == "async"
    cfg = from_verl(rc, tiny_models["llama"])
    assert cfg == PatRolloutConfig(
        model_path=tiny_models["llama"], num_devices=4, initial_tp=1, candidate_tps=(1, 2, 4), kv_handoff="migrate",
        dtype="float32", max_num_seqs=rc.max_num_seqs, seed=rc.seed, steps_per_poll=4,
        planner={"min_batch_per_replica": 4},
    )


def test_defaults_follow_verl(tiny_models):
    rc = rollout_config("actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                        "actor_rollout_ref.rollout.data_parallel_size=2")
    cfg = from_verl(rc, tiny_models["llama"])
    assert (cfg.num_devices, cfg.backend, cfg.policy, cfg.dtype) == (4, "reference", "pat", "bfloat16")
    assert cfg.tp_sizes == (1, 2, 4)


def test_static_baseline_options(tiny_models):
    rc = rollout_config("actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                        "+actor_rollout_ref.rollout.engine_kwargs.pat.policy=static",
                        "+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=2")
    cfg = from_verl(rc, tiny_models["llama"])
    assert cfg.policy == "static" and cfg.tp_sizes == (2,)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+actor_rollout_ref.rollout.engine_kwargs.pat.min_tp=1"],
         "unknown PAT option(s) actor_rollout_ref.rollout.engine_kwargs.pat.min_tp"),
        (["+actor_rollout_ref.rollout.custom.pat.bogus=1"], "actor_rollout_ref.rollout.custom.pat.bogus"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=4",
          "+actor_rollout_ref.rollout.engine_kwargs.pat.candidate_tps=[1,3]"], "TP size 3 must divide num_devices=4"),
        (["+actor_rollout_ref.rollout.engine_kwargs.pat.backend=trtllm"], "backend='trtllm' is unknown"),
        (["+actor_rollout_ref.rollout.engine_kwargs.pat.num_devices=8"], "inconsistent PAT option num_devices=8"),
        (["+actor_rollout_ref.rollout.engine_kwargs.pat.initial_tp=1",
          "+actor_rollout_ref.rollout.custom.pat.initial_tp=2"], "inconsistent PAT option 'initial_tp'"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=8"], "does not fit the model"),  # tiny: 4 heads
    ],
)
def test_bad_options_fail_with_clear_message(tiny_models, overrides, message):
    rc = rollout_config(*overrides)
    with pytest.raises(ValueError) as info:
        from_verl(rc, tiny_models["llama"])
    assert message in str(info.value), str(info.value)
    if "PAT option(s)" in message or "custom.pat.bogus" in message:
        assert all(k in str(info.value) for k in ALLOWED_KEYS)


def test_plugin_yaml_composes(tiny_models):
    import pat_rollout.verl

    config_dir = os.path.join(os.path.dirname(pat_rollout.verl.__file__), "config")
    cfg = compose_ppo(["actor_rollout_ref.rollout.custom.pat.initial_tp=2"], config_dir=config_dir,
                      config_name="pat_ppo")
    from verl.utils.config import omega_conf_to_dataclass

    rc = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert rc.name == "pat"
    pat = from_verl(rc, tiny_models["llama"], check_model=False)
    assert pat.initial_tp == 2 and pat.num_devices == rc.tensor_model_parallel_size


def test_backend_sglang_takes_verl_memory_settings(tiny_models):
    rc = rollout_config("actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
                        "+actor_rollout_ref.rollout.engine_kwargs.pat.backend=sglang",
                        "+actor_rollout_ref.rollout.engine_kwargs.pat.engine_args.chunked_prefill_size=4096")
    cfg = from_verl(rc, tiny_models["llama"])
    assert cfg.backend == "sglang"
    assert cfg.engine_args == {"mem_fraction_static": 0.7, "enable_memory_saver": rc.free_cache_engine,
                               "chunked_prefill_size": 4096}
    with pytest.raises(ValueError, match="engine_args=.* apply to backend='sglang' or 'vllm' only"):
        from_verl(rollout_config("+actor_rollout_ref.rollout.engine_kwargs.pat.engine_args.x=1"),
                  tiny_models["llama"])


def test_pool_gpus_are_the_union_of_its_trainer_ranks():
    from pat_rollout.verl.replica import union_visible_devices

    assert union_visible_devices(["2,3", "0,1", "1", " "]) == "0,1,2,3"
    assert union_visible_devices(["", ""]) == ""


def test_verl_server_with_backend_sglang_starts_the_sglang_pool(tiny_models):
    """engine_kwargs.pat.backend=sglang reaches the driver's SGLang pool through verl's server; in an
    environment without SGLang the start-up says how to install it (tests/sglang_backend run it for real)."""
    import asyncio
    import importlib.util
    from types import SimpleNamespace

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    from pat_rollout.verl.server import PatServer

    cfg = compose_ppo(["actor_rollout_ref.rollout.name=pat", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "+actor_rollout_ref.rollout.engine_kwargs.pat.backend=sglang"])
    path = tiny_models["llama"]
    server = PatServer(config=cfg.actor_rollout_ref.rollout, model_config=SimpleNamespace(local_path=path, path=path),
                       rollout_mode=None, replica_rank=0)
    assert server.pat_config.backend == "sglang"
    with pytest.raises(RuntimeError, match="backend='sglang' needs SGLang.*make install-sglang"):
        asyncio.run(server.launch_server())
