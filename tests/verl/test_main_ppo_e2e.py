"""verl's own trainer end to end on CPU: `python -m verl.trainer.main_ppo` with `rollout.name=pat`, launched by
`examples/grpo_cpu/run.sh` as a user would (tiny random Llama, arithmetic parquet, rule-based reward, Ray actors
as fake GPUs, pat_rollout's CPU platform for verl). Two runs of 2 steps cover, together:

- v1 trainer (TransferQueue), PPO with a critic, reference policy + KL loss, 2 actors, wandb offline (the run's
  wandb files hold the PAT series; verl's legacy trainer never finishes its wandb run, see examples/README.md);
- legacy trainer, GRPO, 4 actors (one pool, TP sizes 1, 2, 4).

A third run, legacy GRPO on 2 actors (the example's default), ran here until December 2026 and was dropped to
keep CI short: the 4-actor GRPO run takes the same trainer, algorithm and checks through the same code (plus TP4),
and the 2-actor PPO run covers a 2-device pool. `bash examples/grpo_cpu/run.sh` still runs it by hand.

Each asserts exit 0, steps 1-2 logged with finite losses, PAT reconfiguring inside every rollout stage
(`pat/num_reconfigs >= 1`, the stage ending in a larger-TP layout), the weights loaded in the base layout, and
verl's rollout-vs-trainer log-prob agreement. Every run has a hard timeout (a Ray deadlock is silent), its own
RAY_TMPDIR and Ray instance, and is never `ray stop`ped: its process group is killed at the end.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("verl")
pytest.importorskip("fastapi")
from e2e_helpers import Run, run_example, wandb_history  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.verl_e2e, pytest.mark.slow, pytest.mark.ray]

STEPS = 2
RUN_TIMEOUT_S = 420  # alone on 2 cores a run takes 50-90 s
PAT = "timing_s/pat/"  # PAT's stage metrics in the trainer's metrics, legacy and v1 (pat_rollout/verl/agent_loop.py)
# Rollout (PAT's engine, fp32) vs trainer (FSDP2, fp32) log-probs of the same tokens after each weight update,
# verl's own metrics (`training/rollout_probs_diff_*`, `training/rollout_actor_probs_pearson_corr`). Measured on
# this example: max |p_rollout - p_trainer| ~1e-6 with and without PAT (policy=static); a stale or misloaded weight
# shard moves it by orders of magnitude.
PROBS_DIFF_MAX = 1e-4
PEARSON_MIN = 0.9999


def check_run(run: Run, losses: tuple[str, ...], max_tp: int) -> None:
    assert run.returncode == 0, run.tail()
    assert sorted(run.steps) == list(range(1, STEPS + 1)), (sorted(run.steps), run.tail())
    for step, m in sorted(run.steps.items()):
        where = f"step {step}"
        for loss in losses:
            assert math.isfinite(m[loss]), (where, loss, m[loss])
        # PAT switched inside this step's rollout stage, and the stage ended in a larger-TP layout ...
        assert m[PAT + "num_reconfigs"] >= 1, (where, {k: v for k, v in m.items() if PAT in k})
        assert m[PAT + "num_failed_reconfigs"] == 0, where
        assert 1 < m[PAT + "stage_end_tp"] <= max_tp, (where, m[PAT + "stage_end_tp"])
        # ... yet the weights were loaded in the base layout (all TP=1), the last time before this stage
        assert m[PAT + "weight_sync_tp"] == 1, (where, m[PAT + "weight_sync_tp"])
        assert m["training/rollout_probs_diff_valid"] == 1, where
        assert m["training/rollout_probs_diff_max"] < PROBS_DIFF_MAX, (where, m["training/rollout_probs_diff_max"])
        assert m["training/rollout_actor_probs_pearson_corr"] > PEARSON_MIN, where


def test_ppo_v1_critic_and_kl_2actors_wandb_offline(tmp_path):
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (setup.py's verl extra)")
    run = run_example(tmp_path, RUN_TIMEOUT_S, ALGO="ppo", KL="1", TRAINER="v1", NUM_ACTORS="2", STEPS=str(STEPS),
                      WANDB="1")
    check_run(run, losses=("actor/pg_loss", "actor/kl_loss", "critic/vf_loss"), max_tp=2)
    rows = [r for r in wandb_history(run.out_dir) if PAT + "num_reconfigs" in r]
    assert [r["_step"] for r in rows] == [1, 2], rows
    assert all(r[PAT + "num_reconfigs"] >= 1 and r[PAT + "gen_time_s"] > 0 for r in rows), rows


def test_grpo_legacy_4actors(tmp_path):
    run = run_example(tmp_path, RUN_TIMEOUT_S, ALGO="grpo", TRAINER="legacy", NUM_ACTORS="4", STEPS=str(STEPS))
    check_run(run, losses=("actor/pg_loss",), max_tp=4)
