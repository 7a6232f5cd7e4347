"""Code that runs inside SGLang's scheduler processes: pat_rollout RPC methods on `Scheduler`.

`run_scheduler_process` is the `Engine.run_scheduler_process_func` of `launch.PatSglEngine`: it adds the
`pat_*` methods (here and in `pool_switch`) to SGLang's `Scheduler` class, sets the process up as an SglPool
rank (`pool_hooks`) and then runs SGLang's own `run_scheduler_process`. The
methods are reached from the driver with `Engine.collective_rpc("pat_...", **kw)` (every rank runs them,
then a TP CPU barrier). `collective_rpc` returns only success/failure, so results come back as files.

Only stdlib, torch and pat_rollout at import time; sglang is imported inside the functions (this module
is imported by spawned children before SGLang's heavy imports).
"""

from __future__ import annotations

from typing import Any

import torch

from pat_rollout.sglang import compat
from pat_rollout.sglang.live_model import _hf_config_dict, _model, _padded_vocab


def pat_save_params(self, save_path: str) -> None:
    """Write this rank's named parameters (SGLang names, local shards) and layout facts to
    `save_path.rank{r}.pt`."""
    model = _model(self)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp_rank, tp_size = compat.tp_rank_size()
    info = dict(tp_rank=tp_rank, tp_size=tp_size, padded_vocab=_padded_vocab(self), hf_config=_hf_config_dict(self))
    torch.save(dict(params=params, info=info), f"{save_path}.rank{tp_rank}.pt")


def pat_check_inventory(self, path: str) -> None:
    """Which attributes of this live scheduler the backend reads are missing (`inventory.SCHEDULER`)."""
    import json

    from sglang.srt.distributed.parallel_state import get_world_group

    from pat_rollout.sglang import inventory

    world = get_world_group()
    with open(f"{path}.rank{world.rank_in_group}.json", "w") as f:
        json.dump(dict(missing=inventory.check_live(inventory.SCHEDULER, scheduler=self, world=world)), f)


def pat_comm_info(self, path: str) -> None:
    """What this rank's layout communicators took at start-up (`layout_comm.INFO`) and which were aborted."""
    import json

    from pat_rollout.sglang import layout_comm, pool_hooks

    st = pool_hooks.STATE
    with open(f"{path}.rank{st.rank}.json", "w") as f:
        json.dump(dict(layout_comm.INFO, custom_ar={str(k): v for k, v in layout_comm.INFO["custom_ar"].items()},
                       aborted=layout_comm.ABORTED, graphs=sorted(st.graphs)), f)


RPC_METHODS = {f.__name__: f for f in (pat_save_params, pat_check_inventory, pat_comm_info)}


def install() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    from pat_rollout.sglang import debug_hooks, kv_room, layout_graphs, memory_spy, pool_hooks, pool_switch, rank_rpc

    compat.apply_cpu_workarounds()
    for name, fn in {**RPC_METHODS, **pool_switch.RPC_METHODS, **memory_spy.RPC_METHODS}.items():
        setattr(Scheduler, name, rank_rpc.reporting(fn))  # each rank writes how it ended (SglPool._rpc)
    if pool_hooks.install():
        layout_graphs.install()  # tests only: PAT_SGLANG_FAKE_GRAPHS records the start-up capture too
        kv_room.install_startup_hooks()  # reclaim_weight_memory: adopt after load_model / the KV pool's allocation
    debug_hooks.install()  # tests only: PAT_SGLANG_SAMPLED_LOG, PAT_SGLANG_STEP_LOG
    memory_spy.install()  # tests only: PAT_SGLANG_MEMORY_SPY


def run_scheduler_process(*args: Any, **kwargs: Any) -> None:
    """SGLang's `run_scheduler_process` with pat_rollout's RPC methods installed first."""
    install()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    from pat_rollout.sglang import pool_hooks

    if pool_hooks.STATE is not None:  # the WORLD rank: SGLang's 4th positional argument, tp_rank
        pool_hooks.set_rank(int(kwargs["tp_rank"] if "tp_rank" in kwargs else args[3]))
        from pat_rollout.sglang import layout_comm, layout_graphs

        layout_comm.start_watcher(pool_hooks.STATE, layout_graphs.json_cfg().get("stack_dir", ""))

    sglang_run(*args, **kwargs)
