"""Driver behaviour at the edges: bad configs fail before any actor starts, a dead actor fails the
in-flight requests with a message naming the device, and weight updates return to the base layout."""

from __future__ import annotations

import json

import pytest
from pool_helpers import pool_config, skewed_requests, wait_first_done

from pat_rollout.driver import RolloutDriver
from pat_rollout.models import make_tiny_model


def test_tp_not_dividing_heads_is_rejected_before_start(tiny_models):
    with pytest.raises(ValueError, match="tp_size=8 must divide num_heads=4"):
        RolloutDriver(pool_config(tiny_models["llama"], num_devices=8, candidate_tps=(1, 2, 8)))


def test_unknown_model_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported model: model_type='gpt2'"):
        RolloutDriver(pool_config(str(tmp_path)))
    with pytest.raises(ValueError, match="has no config.json"):
        RolloutDriver(pool_config(str(tmp_path / "missing")))


def test_reconfigure_to_unbuilt_tp_and_oversized_requests_are_rejected(ray_cluster, tiny_models):
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="static"))
    try:
        with pytest.raises(ValueError, match=r"tp=2 is not one of this pool's TP sizes \(1,\)"):
            driver.reconfigure(2)
        requests = skewed_requests(n=3)
        too_long = skewed_requests(n=1, long_len=400)[0]
        with pytest.raises(ValueError, match="can never fit: needs 103 KV blocks"):
            driver.submit(too_long)
        outputs = driver.generate(requests)  # the pool is unaffected
        assert [len(o.token_ids) for o in outputs] == [r.sampling.max_new_tokens for r in requests]
    finally:
        driver.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_dead_actor_fails_requests_with_clear_error(ray_cluster, tiny_models):
    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="static", steps_per_poll=1, num_kv_blocks=128))
    try:
        futures = [driver.submit(r) for r in skewed_requests(long_len=400)]
        # Kill as soon as a short request finishes: the two long ones (one per replica) still have ~390 steps
        # left. A fixed sleep raced them: on an idle machine all six finished within 0.5 s.
        wait_first_done(futures)
        driver.pool.group.kill(1)
        assert not any(f.done() for f in futures[:2]), "the long requests finished before the kill"
        with pytest.raises(RuntimeError, match=r"device 1's actor died"):
            for f in futures:
                f.result(timeout=120)
    finally:
        driver.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_update_weights_after_reconfiguration(ray_cluster, tiny_models, tmp_path):
    import torch
    from safetensors.torch import load_file

    other = make_tiny_model(tmp_path / "other", "llama", seed=7)
    requests = skewed_requests(n=4, long_len=12)
    fresh = RolloutDriver(pool_config(str(other), policy="static"))
    try:
        expected = fresh.generate(requests)
    finally:
        fresh.shutdown()
    driver = RolloutDriver(pool_config(tiny_models["llama"]))
    try:
        before = driver.generate(requests)
        driver.reconfigure(2)
        weights = load_file(str(other / "model.safetensors"))
        driver.update_weights((name, t.to(torch.float64)) for name, t in weights.items())
        assert str(driver.layout).startswith("2xTP1")  # back in the base layout
        after = driver.generate(requests)
    finally:
        driver.shutdown()
    assert [o.token_ids for o in after] == [o.token_ids for o in expected]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]


def test_sglang_backend_without_sglang_fails_with_install_hint(tiny_models):
    """backend='sglang' selects the SGLang pool; where SGLang is missing it says how to get it, before
    starting anything (never a silent fallback to the reference engine)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here; tests/sglang_backend covers the backend")
    with pytest.raises(RuntimeError, match="backend='sglang' needs SGLang.*make install-sglang"):
        RolloutDriver(pool_config(tiny_models["llama"], backend="sglang"))
