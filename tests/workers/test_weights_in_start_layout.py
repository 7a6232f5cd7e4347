"""Issue #24 item 5: the weight update loads each device's shard of the layout the planner will start the next stage
in, so that stage starts without a switch; the host backup (the base-layout shard a failed switch or load rolls back
to) holds the new weights; a load that fails on one device rolls every device back to one consistent state."""

from __future__ import annotations

import pytest
import torch
from pool_helpers import bounded, pool_config, skewed_requests
from safetensors.torch import load_file

from pat_rollout.driver import RolloutDriver
from pat_rollout.engine.ref.loader import empty_shards, load_tensors
from pat_rollout.layout import Layout, model_shard_specs
from pat_rollout.models import make_tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The hand-made profile: TP2 wins a batch of 2 requests (as in test_planner_driven); calibration records but does
# not correct, so the choice follows the profile whatever this machine's timings.
PLANNER = {"eval_every_steps": 2, "min_steps_between_switches": 2, "min_gain_s": 0.0, "min_gain_ratio": 0.0,
           "start_layout": True, "calibrate": False}


def expected_shards(driver: RolloutDriver, weights: dict[str, torch.Tensor], layout: Layout,
                    device: int) -> dict[str, torch.Tensor]:
    """Device `device`'s shard of `weights` in `layout`, loaded by the engine's own loader from scratch."""
    specs = model_shard_specs(driver.spec, driver.config.max_tp)
    _, rank = layout.position(device)
    shards = empty_shards(specs, rank, layout.tp_size, torch.float64)
    load_tensors(shards, specs, weights.items(), rank, layout.tp_size, require_all=True)
    return shards


def check_weights(driver: RolloutDriver, weights: dict[str, torch.Tensor]) -> None:
    """Every device serves its shard of `weights` in the current layout and backs up its base-layout shard."""
    for d, w in enumerate(driver.pool.group.call(range(driver.config.num_devices), "weight_shards")):
        for kind, layout in (("engine", driver.layout), ("backup", driver.base)):
            want = expected_shards(driver, weights, layout, d)
            assert w[kind].keys() == want.keys()
            wrong = [n for n, t in want.items() if not torch.equal(w[kind][n], t)]
            assert not wrong, f"device {d} {kind} ({layout}): {wrong}"


def buckets(weights: dict[str, torch.Tensor], num: int = 3) -> list[list[tuple[str, torch.Tensor]]]:
    """An update as verl sends it: several buckets of full tensors."""
    items = sorted(weights.items())
    return [items[i::num] for i in range(num)]


def load_then_generate(driver: RolloutDriver, weights: dict[str, torch.Tensor], requests) -> tuple[list, dict]:
    """Load `weights` bucket by bucket: the pool ends in the planner's start layout (1 x TP2), every device serves
    and backs up its shard, and the next stage starts there without a switch. Returns its outputs and metrics."""
    for bucket in buckets(weights):
        bounded(lambda b=bucket: driver.update_weights(b), 120)
    assert driver.layout.tp_size == 2
    check_weights(driver, weights)
    out = bounded(lambda: driver.generate(requests, timeout=300), 300)
    m = driver.stage_metrics()
    assert m["pat/num_reconfigs"] == 0 and m["pat/layouts"].startswith("1xTP2"), m
    return out, m


def test_weights_load_in_the_next_start_layout_and_roll_back_consistently(ray_cluster, tiny_models, tiny_profile,
                                                                          tmp_path):
    first = {n: t.to(torch.float64) for n, t in load_file(f"{tiny_models['llama']}/model.safetensors").items()}
    other_path = make_tiny_model(tmp_path / "other", "llama", seed=7)
    second = {n: t.to(torch.float64) for n, t in load_file(str(other_path / "model.safetensors")).items()}
    few = skewed_requests(n=2, long_len=24)
    static = RolloutDriver(pool_config(tiny_models["llama"], policy="static"))
    try:  # the static reference: base layout, where weights were always loaded
        ref_first = static.generate(few, timeout=300)
        for bucket in buckets(second):
            static.update_weights(bucket)
        ref_second = static.generate(few, timeout=300)
    finally:
        static.shutdown()
    assert [o.token_ids for o in ref_first] != [o.token_ids for o in ref_second]

    driver = RolloutDriver(pool_config(tiny_models["llama"], policy="pat", profile_path=tiny_profile,
                                       planner=PLANNER))
    try:
        out1 = bounded(lambda: driver.generate(few, timeout=300), 300)
        m1 = driver.stage_metrics()
        assert m1["pat/layouts"].startswith("2xTP1") and m1["pat/num_reconfigs"] == 1, m1  # the planner picks TP2
        assert driver.planner.next_start_tp() == 2 and driver.layout.tp_size == 2

        # 1. the pool is in the next start layout: every bucket loads in place, no switch
        out2, m2 = load_then_generate(driver, second, few)
        assert m2["pat/layouts"].count("TP") == 1, m2  # starts where it loaded

        # 2. the pool is elsewhere (a caller switched back): the first bucket switches it, the rest load in place
        bounded(lambda: driver.reconfigure(1), 120)
        assert driver.layout == driver.base
        out3, _ = load_then_generate(driver, first, few)

        # 3. a bucket that fails on one device after loading there: every device back in the base layout, engine
        # and backup equal to what the backup held (this bucket's previous weights, the earlier bucket kept)
        new_first, new_second = buckets(second, 2)
        bounded(lambda: driver.update_weights(new_first), 120)
        driver.pool.group.call([1], "fail_next", "weights")
        with pytest.raises(RuntimeError, match=r"injected failure in phase 'weights' on device 1") as err:
            bounded(lambda: driver.update_weights(new_second), 120)
        assert "rolled back to the base layout" in "".join(getattr(err.value, "__notes__", []))
        assert driver.layout == driver.base and driver.broken is None
        mixed = {**first, **dict(new_first)}  # the failed bucket kept its previous (first) weights everywhere
        check_weights(driver, mixed)
        bounded(lambda: driver.update_weights(new_second), 120)  # the retry lands
        check_weights(driver, second)
        out4 = bounded(lambda: driver.generate(few, timeout=300), 300)
    finally:
        driver.shutdown()
    assert [o.token_ids for o in out1] == [o.token_ids for o in ref_first]
    assert [o.token_ids for o in out2] == [o.token_ids for o in ref_second]
    assert [o.token_ids for o in out3] == [o.token_ids for o in ref_first]
    assert [o.token_ids for o in out4] == [o.token_ids for o in ref_second]
