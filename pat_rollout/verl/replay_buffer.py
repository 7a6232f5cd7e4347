"""`PatReplayBuffer`: verl's v1 replay buffer plus PAT's per-stage metrics, for the v1 trainer.

Selected with
    trainer.v1.sampler.custom_sampler.path=pkg://pat_rollout.verl.replay_buffer
    trainer.v1.sampler.custom_sampler.name=PatReplayBuffer

Why a sampler (verl 0.9.1, `verl/trainer/ppo/v1/trainer_base.py`): the v1 trainer's `_step_once` takes its batch
from `self.replay_buffer.sample(...)`, which returns `(batch, metrics)`, and merges those metrics into the step's
logged metrics; it is the only step-metrics path a plug-in can reach by config (the AgentLoopManager only
dispatches prompts, and `_compute_metrics` reads fixed TransferQueue fields). `sample` returns once the stage's
outputs are in TransferQueue, i.e. after every PAT pool finished the stage, and the sync trainer dispatches the
next stage only in the next step's `prepare_step`, so the pools' `stage_metrics()` are those of this step.

The keys are the legacy trainer's (`pat_rollout/verl/agent_loop.py`): `timing_s/pat/<k>` (mean over pools) and
`timing_s/pat/<k>/max`, so one dashboard serves both trainers. Only `trainer.v1.trainer_mode=sync` (verl's default)
has one stage per step; the async modes interleave stages with training and are refused. verl passes a custom
sampler only the generic constructor arguments, so verl's DAPO group filtering (`algorithm.filter_groups`) and
`sync_refill_failed_groups` are not available with this sampler.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from pat_rollout.verl.agent_loop import REPLAY_BUFFER_PATH, policy_server_handles
from pat_rollout.verl.replica import reduce_pat_metrics

logger = logging.getLogger(__name__)

PATH = REPLAY_BUFFER_PATH
NAME = "PatReplayBuffer"
PREFIX = "timing_s/"  # what verl's compute_timing_metrics puts before the legacy trainer's timing_s/pat/* keys


def pat_stage_metrics() -> dict[str, float]:
    """PAT's numeric stage metrics of all policy pools as `timing_s/pat/*`; {} (logged) when they cannot be read."""
    try:
        per_pool = ray.get([s.get_metrics.remote() for s in policy_server_handles()])
    except Exception:  # metrics must never fail a training step
        logger.exception("pat_rollout: collecting PAT stage metrics failed; this step logs none")
        return {}
    return {PREFIX + k: v for k, v in reduce_pat_metrics(per_pool).items()}


class PatReplayBuffer(ReplayBuffer):
    """verl's sync ReplayBuffer whose training `sample` also returns PAT's stage metrics, once per global step."""

    def __init__(self, trainer_mode: str, *args: Any, **kwargs: Any) -> None:
        if trainer_mode != "sync":
            raise ValueError(f"{NAME} supports trainer.v1.trainer_mode=sync only (one generation stage per step), "
                             f"got trainer_mode={trainer_mode!r}; unset trainer.v1.sampler.custom_sampler for the "
                             "async trainers")
        super().__init__(trainer_mode, *args, **kwargs)
        self._reported_step: int | None = None

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict]:
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        # parameter_sync_step > 1 samples one stage several times: report it once (v1 sums timing_s/* keys).
        if partition_id == "train" and self._reported_step != global_steps:
            self._reported_step = global_steps
            metrics = {**metrics, **pat_stage_metrics()}
        return batch, metrics
