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

from dataclasses import replace
from typing import Any

import torch

from pat_rollout.layout.shard import Partition, ShardSpec, model_shard_specs
from pat_rollout.sglang import compat
from pat_rollout.types import ModelSpec

VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


def sglang_specs(hf_config: dict[str, Any], padded_vocab: int) -> dict[str, ShardSpec]:
    """pat_rollout shard specs with SGLang's names and SGLang's vocab padding (`pad_vocab_size(v, 64)`,
    not pat_rollout's `padded_vocab_size(v, max_tp)`), so they describe SGLang's params exactly."""
    spec = ModelSpec.from_hf_config(hf_config)
    specs = model_shard_specs(spec, max_tp=1)
    for name in VOCAB_PARAMS:
        if name in specs:
            s = specs[name]
            specs[name] = replace(s, shape=(padded_vocab,) + s.shape[1:],
                                  partitions=(Partition(num_units=padded_vocab, unit_size=1),))
    return specs


def _model(self) -> torch.nn.Module:
    return self.tp_worker.model_runner.model


def _hf_config_dict(self) -> dict[str, Any]:
    return self.tp_worker.model_runner.model_config.hf_config.to_dict()


def _padded_vocab(self) -> int:
    emb = _model(self).model.embed_tokens
    return int(emb.num_embeddings_padded)


def pat_save_params(self, path: str) -> None:
    """Write this rank's named parameters (SGLang names, local shards) and layout facts to `path.rank{r}.pt`."""
    model = _model(self)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp_rank, tp_size = compat.tp_rank_size()
    info = dict(tp_rank=tp_rank, tp_size=tp_size, padded_vocab=_padded_vocab(self), hf_config=_hf_config_dict(self))
    torch.save(dict(params=params, info=info), f"{path}.rank{tp_rank}.pt")


def _bind(new: torch.nn.Module, slot: str, sources: dict[str, torch.Tensor], targets) -> None:
    """Put each `sources[name]` into `new` in place of its same-named meta tensor (`slot`: _parameters or _buffers),
    refusing any shape that differs from what SGLang's constructor made for the current TP."""
    for name, t in list(targets):
        src = sources[name]
        if tuple(src.shape) != tuple(t.shape):
            raise RuntimeError(f"{name}: resharded shape {tuple(src.shape)} != new module's {tuple(t.shape)}")
        mod, _, leaf = name.rpartition(".")
        getattr(new.get_submodule(mod), slot)[leaf] = src


def rebuild_model_for_current_tp(old: torch.nn.Module, params: dict[str, torch.Tensor] | None = None
                                 ) -> torch.nn.Module:
    """A new module tree of `type(old)` built for the TP in the current runtime context (on the meta device,
    no weight memory), with `old`'s Parameter objects (already resharded in place) and buffers bound into it;
    tensors in `params` (new shards that could not be resharded in place, or a backup) replace them by name.
    Module attributes fixed at construction (heads per rank, q/kv sizes, partition sizes, vocab shard
    indices, logits gather flag, group handles) thereby come from SGLang's own constructors."""
    with torch.device("meta"):
        new = type(old)(config=old.config, quant_config=getattr(old, "quant_config", None))
    old_params = dict(old.named_parameters())
    for name, t in (params or {}).items():
        old_params[name] = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
    _bind(new, "_parameters", old_params, new.named_parameters())
    _bind(new, "_buffers", dict(old.named_buffers()), new.named_buffers())
    # Attributes SGLang's loader sets on modules after construction (e.g. `shared_experts_config`).
    new_mods = dict(new.named_modules())
    for mname, omod in old.named_modules():
        nmod = new_mods.get(mname)
        if nmod is not None:
            for k, v in omod.__dict__.items():
                if k not in nmod.__dict__:
                    nmod.__dict__[k] = v
    leftover = [n for n, t in list(new.named_parameters()) + list(new.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on meta after rebinding: {leftover[:5]}")
    return new


def pat_check_inventory(self, path: str) -> None:
    """Which attributes of this live scheduler the backend reads are missing (`inventory.SCHEDULER`)."""
    import json

    from sglang.srt.distributed.parallel_state import get_world_group

    from pat_rollout.sglang import inventory

    world = get_world_group()
    with open(f"{path}.rank{world.rank_in_group}.json", "w") as f:
        json.dump(dict(missing=inventory.check_live(inventory.SCHEDULER, scheduler=self, world=world)), f)


RPC_METHODS = {f.__name__: f for f in (pat_save_params, pat_check_inventory)}


def install() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    from pat_rollout.sglang import debug_hooks, memory_spy, pool_hooks, pool_switch

    compat.apply_cpu_workarounds()
    for name, fn in {**RPC_METHODS, **pool_switch.RPC_METHODS, **memory_spy.RPC_METHODS}.items():
        setattr(Scheduler, name, fn)
    pool_hooks.install()
    debug_hooks.install()  # tests only: PAT_SGLANG_SAMPLED_LOG
    memory_spy.install()  # tests only: PAT_SGLANG_MEMORY_SPY


def run_scheduler_process(*args: Any, **kwargs: Any) -> None:
    """SGLang's `run_scheduler_process` with pat_rollout's RPC methods installed first."""
    install()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    from pat_rollout.sglang import pool_hooks

    if pool_hooks.STATE is not None:  # the WORLD rank: SGLang's 4th positional argument, tp_rank
        pool_hooks.set_rank(int(kwargs["tp_rank"] if "tp_rank" in kwargs else args[3]))

    sglang_run(*args, **kwargs)
