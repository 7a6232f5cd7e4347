"""`PatReplica`: verl's unit of rollout serving, mapped onto one PAT pool.

Mapping (decided here, documented in recipes/deepscaler/README.md):

- A verl replica spans `world_size = tensor_model_parallel_size * data_parallel_size` GPUs (pp must be 1).
  For PAT that whole slice is ONE pool of `num_devices = tp * dp` devices, served by ONE `PatServer` actor that
  owns a `RolloutDriver`. PAT regroups TP *inside* the pool: it starts with `num_devices / initial_tp` replicas
  of TP `initial_tp` and merges them into fewer, larger-TP replicas as the batch drains.
- So set `rollout.tensor_model_parallel_size` to the pool size (typically 8 = one node) and
  `data_parallel_size=1`; verl then builds `n_gpus / 8` PAT pools, one per node, each with its own server in
  the load balancer. The TP sizes PAT may use come from `engine_kwargs.pat.{initial_tp,candidate_tps}`.
- The trainer-rank -> replica mapping stays verl's (`RANK // (tp*dp)`), so the ServerAdapter of infer-TP
  rank 0 of each pool forwards weights to that pool's server.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import os
from collections.abc import Callable, Sequence
from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplica

from pat_rollout.verl.config import from_verl
from pat_rollout.verl.server import PatServer, model_local_path

logger = logging.getLogger(__name__)


def server_actor_name(replica_rank: int, name_suffix: str = "", role: str = "") -> str:
    """Ray actor name of a replica's PatServer; the ServerAdapter finds its server by this name."""
    return f"pat_server_{role + '_' if role else ''}{replica_rank}{name_suffix}"


def union_visible_devices(per_worker: Sequence[str]) -> str:
    """The GPUs a pool runs on: the union of its trainer ranks' visible-device lists ("0,1", "2", ...), sorted,
    as verl's own SGLang server computes it."""
    return ",".join(str(d) for d in sorted({int(x) for devs in per_worker for x in devs.split(",") if x.strip()}))


class PatReplica(RolloutReplica):
    """One verl rollout replica = one PAT pool of `tp * dp` devices behind one PatServer actor."""

    # Builds the driver inside the server actor; None means pat_rollout.driver.RolloutDriver.
    # Tests may set a factory (it is pickled by value into the actor).
    driver_factory: Callable[[Any], Any] | None = None

    def __init__(self, replica_rank: int, config: Any, model_config: Any, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = "") -> None:
        super().__init__(replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model,
                         name_suffix)
        if self.nnodes > 1:
            raise ValueError(
                f"a PAT pool must fit one node: tensor_model_parallel_size * data_parallel_size = {self.world_size} "
                f"> n_gpus_per_node = {gpus_per_node}; use a pool size <= {gpus_per_node}")
        # Fail at start-up, in the trainer process, on bad PAT options (ValueError names the key).
        self.pat_config = from_verl(self.config, model_local_path(model_config))
        self.server_class = ray.remote(PatServer)

    async def launch_servers(self) -> None:
        role = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""
        options: dict[str, Any] = {
            "name": server_actor_name(self.replica_rank, self.name_suffix, role),
            "max_concurrency": self.max_concurrency,
            "num_cpus": 0,  # a control-plane actor: the driver's device actors do the work
        }
        visible = None
        if self.workers:  # hybrid/colocated: run next to the trainer ranks, on the GPUs they hold
            from verl.plugin.platform import get_platform
            from verl.utils.device import get_visible_devices_keyword

            keyword = get_visible_devices_keyword()
            infos = await asyncio.gather(*[w.__ray_call__.remote(
                lambda _, k=keyword: (ray.get_runtime_context().get_node_id(), os.environ.get(k, "")))
                for w in self.workers])
            visible = union_visible_devices([devs for _, devs in infos]) or None
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=infos[0][0], soft=False)
            if visible:  # Ray must not reset the visible devices the server (and SGLang's ranks) inherit
                options["runtime_env"] = {"env_vars": {var: "1" for var in get_platform().ray_noset_envvars()}}
        server = self.server_class.options(**options).remote(
            config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank, driver_factory=type(self).driver_factory, visible_devices=visible,
        )
        await server.launch_server.remote()
        address, port = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"

    async def wake_up(self) -> None:
        await self._server_handle.wake_up.remote()

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self._server_handle.abort_all_requests.remote(reject_request=reject_request)

    async def get_metrics(self) -> dict[str, float]:
        """`pat/*` metrics of this pool's last generation stage."""
        return await self._server_handle.get_metrics.remote()

    async def shutdown(self) -> None:
        await self._server_handle.shutdown.remote()


def reduce_pat_metrics(per_pool: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Reduce the stage metrics of several PAT pools: `pat/<name>` is the mean over pools, `pat/<name>/max`
    the max. Non-numeric entries (e.g. the `pat/layouts` trace string) and `pat/replica_rank` are left out."""
    out: dict[str, float] = {}
    numeric = [{k: float(v) for k, v in m.items() if isinstance(v, numbers.Real)}
               for m in per_pool]
    for key in sorted({k for m in numeric for k in m} - {"pat/replica_rank"}):
        values = [m[key] for m in numeric if key in m]
        out[key] = sum(values) / len(values)
        out[f"{key}/max"] = max(values)
    return out


async def collect_pat_metrics(replicas: Sequence[PatReplica]) -> dict[str, float]:
    """Numeric stage metrics of all PAT pools (see `reduce_pat_metrics`); `PatReplica.get_metrics` has the
    non-numeric ones. In training, `pat_rollout.verl.agent_loop.PatAgentLoopManager` does this per step.
    """
    return reduce_pat_metrics(await asyncio.gather(*[r.get_metrics() for r in replicas]))
