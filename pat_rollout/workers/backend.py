"""The reference backend (`backend="reference"`, see `pat_rollout.backends`): the plain-PyTorch engine, one Ray
`ShardWorker` actor per device, grouped into layouts by a `WorkerGroup` and reconfigured by a `Reconfigurer`."""

from __future__ import annotations

from pat_rollout.config import DTYPE_BYTES, PatRolloutConfig
from pat_rollout.engine.ref.config import RefEngineConfig
from pat_rollout.kv.cost import HandoffCost
from pat_rollout.layout import Layout, model_shard_specs
from pat_rollout.types import ModelSpec
from pat_rollout.workers.pool import RefPool
from pat_rollout.workers.reconfigure import Reconfigurer

# Measured on this project's CPU machines with `python -m pat_rollout.profile`.
DEFAULT_PROFILE = "cpu_ref_llama_demo"


def engine_config(config: PatRolloutConfig) -> RefEngineConfig:
    """The engine's own config; it validates the checkpoint."""
    return RefEngineConfig(model_path=config.model_path, dtype=config.dtype, max_tp=config.max_tp,
                           block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
                           max_num_seqs=config.max_num_seqs)


def model_spec(config: PatRolloutConfig) -> ModelSpec:
    engine = engine_config(config)
    spec = engine.model_spec()
    for tp in config.tp_sizes:
        engine.check_tp(spec, tp)
    return spec


def build_pool(config: PatRolloutConfig, spec: ModelSpec, base: Layout, *, cost: HandoffCost | None,
               num_cpus_per_worker: float) -> RefPool:
    from pat_rollout.workers.group import WorkerGroup  # Ray: only when a pool starts

    engine = engine_config(config)
    group = WorkerGroup(num_cpus_per_worker=num_cpus_per_worker, world_size=config.num_devices, engine=engine,
                        initial_layout=base, tp_sizes=config.tp_sizes, comm_timeout_s=config.comm_timeout_s,
                        default_timeout_s=config.rpc_deadline_s(),
                        transfer_timeout_floor_s=config.transfer_timeout_floor_s,
                        transfer_min_bytes_per_s=config.transfer_min_bytes_per_s,
                        transfer_chunk_bytes=config.transfer_chunk_bytes)
    reconfigurer = Reconfigurer(group, spec, model_shard_specs(spec, config.max_tp), base,
                                handoff=config.kv_handoff, cost=cost, dtype_bytes=DTYPE_BYTES[config.dtype],
                                deadline=config.rpc_deadline_s, kv_cap_bytes=config.kv_handoff_cap())
    return RefPool(group, reconfigurer, base, engine, deadline=config.rpc_deadline_s,
                   max_num_seqs=config.max_num_seqs, kv_capacity_tokens=config.num_kv_blocks * config.block_size)
