"""`PatAgentLoopManager`: verl's AgentLoopManager plus PAT's per-iteration stage metrics.

Selected with `actor_rollout_ref.rollout.agent.agent_loop_manager_class=pat_rollout.verl.agent_loop.PatAgentLoopManager`
(set by recipes/deepscaler and pat_rollout/verl/config/pat_ppo.yaml).

How the metrics reach the logged `metrics` dict depends on verl's trainer (verl 0.9.1):

- Legacy trainer (`trainer.use_v1=False`, `verl/trainer/ppo/ray_trainer.py::RayPPOTrainer.fit`):
  `gen_output = async_rollout_manager.generate_sequences(batch)`, then `checkpoint_manager.sleep_replicas()`,
  then `timing_raw.update(gen_output.meta_info["timing"])`; at the end of the step
  `metrics.update(compute_timing_metrics(batch, timing_raw))` turns every `timing_raw[k]` into `timing_s/<k>`,
  and `logger.log(data=metrics, ...)` sends them to wandb. (`meta_info["metrics"]` of the workers is a list of
  per-sample dicts that AgentLoopManager itself pops and reduces into `timing`; the trainer never reads it.)
  So `generate_sequences` below merges the pool-reduced numeric PAT metrics into `meta_info["timing"]`:
  they are logged as `timing_s/pat/gen_time_s`, `timing_s/pat/gen_time_s/max`, ... They are read before
  `sleep_replicas`, i.e. for the stage that just finished.
- V1 trainer (`trainer.use_v1=True`, the default; `verl/trainer/ppo/v1/trainer_base.py`): the manager's
  `generate_sequences` only dispatches prompts (it returns None; outputs go to TransferQueue) and the trainer
  reads nothing a custom AgentLoopManager returns. `create` therefore hands back verl's plain
  `AgentLoopManagerTQ` there (so one config value works for both trainers), and PAT's metrics reach the v1
  trainer through its replay buffer instead: `pat_rollout.verl.replay_buffer.PatReplayBuffer`
  (`trainer.v1.sampler.custom_sampler`), under the same `timing_s/pat/*` names.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import ray
from verl.experimental.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await

from pat_rollout.verl.replica import reduce_pat_metrics

logger = logging.getLogger(__name__)

FQN = "pat_rollout.verl.agent_loop.PatAgentLoopManager"
REPLAY_BUFFER_PATH = "pkg://pat_rollout.verl.replay_buffer"  # = replay_buffer.PATH (that module imports this one)
# Policy-rollout PatServer actors (see replica.server_actor_name); reward/teacher servers carry a role infix.
_POLICY_SERVER_NAME = re.compile(r"^pat_server_\d+$")


def _uses_v1_agent_loop(config: Any) -> bool:
    """True where the caller is verl's V1 TaskRunner: it sets `transfer_queue.enable=True` before creating the
    manager and expects an AgentLoopManagerTQ (outputs go to TransferQueue)."""
    tq = config.get("transfer_queue", None) if hasattr(config, "get") else None
    return bool(tq is not None and tq.get("enable", False))


def policy_server_handles() -> list[Any]:
    """The PatServer actors of the policy rollout, found by their Ray actor names in this job's namespace."""
    names = sorted((n for n in ray.util.list_named_actors() if _POLICY_SERVER_NAME.match(n)),
                   key=lambda n: int(n.rsplit("_", 1)[1]))
    return [ray.get_actor(n) for n in names]


async def gather_pat_metrics(servers: list[Any] | None = None) -> dict[str, float]:
    """Numeric stage metrics of all PAT pools (mean as `pat/<k>`, max as `pat/<k>/max`); {} on failure."""
    try:
        servers = policy_server_handles() if servers is None else servers
        per_pool = await asyncio.gather(*[s.get_metrics.remote() for s in servers])
    except Exception:  # metrics must never fail a training step
        logger.exception("pat_rollout: collecting PAT stage metrics failed; this step logs none")
        return {}
    return reduce_pat_metrics(per_pool)


class PatAgentLoopManager(AgentLoopManager):
    """AgentLoopManager whose output carries PAT's stage metrics in `meta_info["timing"]` (see module doc)."""

    @classmethod
    def create(cls, *args: Any, **kwargs: Any):
        config = kwargs.get("config", args[0] if args else None)
        if _uses_v1_agent_loop(config):
            from verl.trainer.ppo.v1 import AgentLoopManagerTQ

            sampler = config.trainer.v1.sampler.get("custom_sampler", None) or {}
            if sampler.get("path") != REPLAY_BUFFER_PATH:
                logger.warning("pat_rollout: the V1 trainer reads no metrics from the AgentLoopManager; to log PAT's "
                               "stage metrics (timing_s/pat/*) set trainer.v1.sampler.custom_sampler.path=%s and "
                               ".name=PatReplayBuffer (pat_rollout/verl/replay_buffer.py)", REPLAY_BUFFER_PATH)
            return AgentLoopManagerTQ.create(*args, **kwargs)
        return super().create(*args, **kwargs)

    @auto_await
    async def generate_sequences(self, prompts):
        output = await super().generate_sequences(prompts)
        pat = await gather_pat_metrics()
        output.meta_info.setdefault("timing", {}).update(pat)
        return output
