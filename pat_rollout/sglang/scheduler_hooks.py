"""Code that runs inside SGLang's scheduler processes: pat_rollout RPC methods on `Scheduler`.

`run_scheduler_process` is the `Engine.run_scheduler_process_func` of `regroup.PatSglEngine`: it adds the
`pat_*` methods to SGLang's `Scheduler` class and then runs SGLang's own `run_scheduler_process`. The
methods are reached from the driver with `Engine.collective_rpc("pat_...", **kw)` (every rank runs them,
then a TP CPU barrier). `collective_rpc` returns only success/failure, so results come back as files.

Only stdlib, torch and pat_rollout at import time; sglang is imported inside the functions (this module
is imported by spawned children before SGLang's heavy imports).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pat_rollout.comm.transport import Transport
from pat_rollout.layout.layout import Layout
from pat_rollout.layout.shard import Partition, ShardSpec, model_shard_specs
from pat_rollout.layout.transition import plan_layout, plan_weights
from pat_rollout.reshard.apply import reshard_local
from pat_rollout.types import ModelSpec

VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


class LocalOnlyTransport(Transport):
    """For plans where this device only keeps slices of what it holds (TP grow): any send/recv is a bug."""

    def __init__(self, device: int) -> None:
        self.device = device

    def submit_send(self, tensor: torch.Tensor, dst_device: int, task_id: int) -> None:
        raise RuntimeError(f"device {self.device}: plan needs a send (task {task_id} -> {dst_device}); "
                           "only grow-by-merge plans run without a transport")

    def submit_recv(self, tensor: torch.Tensor, src_device: int, task_id: int) -> None:
        raise RuntimeError(f"device {self.device}: plan needs a recv (task {task_id} <- {src_device}); "
                           "only grow-by-merge plans run without a transport")

    def run(self) -> None:
        pass


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


def _tp(self) -> tuple[int, int]:
    from sglang.srt.runtime_context import get_parallel

    ctx = get_parallel()
    return int(ctx.tp_rank), int(ctx.tp_size)


def _padded_vocab(self) -> int:
    emb = _model(self).model.embed_tokens
    return int(emb.num_embeddings_padded)


def pat_save_params(self, path: str) -> None:
    """Write this rank's named parameters (SGLang names, local shards) and layout facts to `path.rank{r}.pt`."""
    model = _model(self)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp_rank, tp_size = _tp(self)
    info = dict(tp_rank=tp_rank, tp_size=tp_size, padded_vocab=_padded_vocab(self), hf_config=_hf_config_dict(self))
    torch.save(dict(params=params, info=info), f"{path}.rank{tp_rank}.pt")


def pat_reshard_in_place(self, src_groups: list[list[int]], device: int, dst_tp: int, path: str) -> None:
    """Reshard this process's SGLang parameters in place for the move `src_groups` -> TP `dst_tp`.

    Runs pat_rollout's plan (`plan_layout` rank order + `plan_weights`) and `reshard_local` on the live
    `nn.Parameter`s of SGLang's model: kept slices are compacted inside each parameter's own storage and
    the same Parameter objects are re-viewed at the new shape (they stay bound to their modules). Writes
    the new shards plus identity/shape facts to `path.dev{device}.pt` for the driver and tests.

    After this the process's *modules* still have the old TP's attribute values (heads per rank, vocab
    shard indices, group handles), so it must not serve until they are rebuilt (see README.md).
    """
    src = Layout(tuple(tuple(g) for g in src_groups))
    dst = plan_layout(src, dst_tp)
    model = _model(self)
    specs = sglang_specs(_hf_config_dict(self), _padded_vocab(self))
    named = dict(model.named_parameters())
    missing = sorted(set(specs) - set(named) - {"lm_head.weight"})
    if missing:
        raise RuntimeError(f"SGLang model lacks params the plan covers: {missing}")
    specs = {n: s for n, s in specs.items() if n in named}
    plan = plan_weights(src, dst, specs)
    sharded = {n: named[n] for n in specs if specs[n].dim is not None}
    ids_before = {n: id(p) for n, p in sharded.items()}
    with torch.no_grad():
        out = reshard_local(sharded, plan, device, LocalOnlyTransport(device))
    same_object = {n: out[n] is named[n] and id(out[n]) == ids_before[n] for n in sharded}
    _, new_rank = dst.position(device)
    # The hand-off carries every parameter of the new shard: resharded ones plus replicated norms.
    held = {n: (out[n] if n in out else named[n]) for n in specs}
    torch.save(dict(params={n: p.detach().clone() for n, p in held.items()}, same_object=same_object,
                    new_rank=new_rank, dst_groups=[list(g) for g in dst.groups],
                    num_transfers=len(plan.transfers_for(device)),
                    num_moved=sum(1 for t in plan.transfers_for(device) if not t.is_local)),
               f"{path}.dev{device}.pt")


# ---- in-process grow: ranks built as TP=1 replicas, switched to one TP=world group in place ----------------

BUILD_TP1_ENV = "PAT_SGLANG_BUILD_TP1"
_GROUPS: dict[str, Any] = {}  # cached GroupCoordinators, created once per process, never destroyed


def cached_singleton_group():
    """[[0], [1], ...]: one TP=1 group per rank of the WORLD, built once (collective over the WORLD)."""
    if "tp1" not in _GROUPS:
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_world_group, init_model_parallel_group

        world = get_world_group()
        _GROUPS["tp1"] = init_model_parallel_group(
            [[r] for r in range(world.world_size)], world.local_rank, dist.get_backend(world.device_group),
            use_pynccl=False, use_custom_allreduce=False, group_name="pat_tp1")
    return _GROUPS["tp1"]


def _wrap_load_model_tp1() -> None:
    """Make ModelRunner.load_model build and load the model as a TP=1 replica on every rank (full weights,
    TP=1 module shapes) under SGLang's own `patch_tensor_parallel_group` with the cached singleton group.
    The KV pool and everything else are still built for the engine's TP."""
    from sglang.srt.distributed.parallel_state import patch_tensor_parallel_group
    from sglang.srt.model_executor.model_runner import ModelRunner

    orig = ModelRunner.load_model
    if getattr(orig, "_pat_wrapped", False):
        return

    def load_model(self):
        with patch_tensor_parallel_group(cached_singleton_group(), owns_attention=True):
            return orig(self)

    load_model._pat_wrapped = True
    ModelRunner.load_model = load_model


def _wrap_runner_tp1() -> None:
    """Serving TP=1 replicas inside a TP=2 engine: ModelRunner (model, KV pool, attention backend) is built
    under the cached singleton group, and every forward runs under it until `pat_regroup_grow` clears
    `runner._pat_tp1`. Both ranks receive the same batches (rank 0 broadcasts them over SGLang's TP CPU
    group), so the two TP=1 replicas compute the same thing; rank 0 answers."""
    from sglang.srt.distributed.parallel_state import patch_tensor_parallel_group
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tp_worker import TpModelWorker

    if getattr(Scheduler.init_tp_model_worker, "_pat_wrapped", False):
        return
    orig_fwd = TpModelWorker.forward_batch_generation

    def under_tp1(orig):  # only the builders of model, KV pools and attention backends; the scheduler's own
        def run(self, *a, **kw):  # groups (request broadcast, barriers) stay SGLang's TP=2 groups
            with patch_tensor_parallel_group(cached_singleton_group(), owns_attention=True):
                out = orig(self, *a, **kw)
            self.tp_worker.model_runner._pat_tp1 = True
            return out

        run._pat_wrapped = True
        return run

    for name in ("init_tp_model_worker", "init_memory_pools", "init_all_attention_backends"):
        setattr(Scheduler, name, under_tp1(getattr(Scheduler, name)))

    def fwd(self, *a, **kw):
        if getattr(self.model_runner, "_pat_tp1", False):
            with patch_tensor_parallel_group(cached_singleton_group(), owns_attention=True):
                return orig_fwd(self, *a, **kw)
        return orig_fwd(self, *a, **kw)

    TpModelWorker.forward_batch_generation = fwd


def slice_kv_pool_heads(pool, head_lo: int, head_hi: int) -> None:
    """Keep KV heads [head_lo, head_hi) of every layer's K/V buffer (NHD `[rows, H, D]`): the new TP rank's
    KV is a slice of what the TP=1 replica holds, so cached tokens stay valid across the switch."""
    pool.k_buffer = [b[:, head_lo:head_hi].contiguous() for b in pool.k_buffer]
    pool.v_buffer = [b[:, head_lo:head_hi].contiguous() for b in pool.v_buffer]
    pool.head_num = head_hi - head_lo
    pool.row_dim = pool.head_num * pool.head_dim
    pool.v_row_dim = pool.head_num * pool.v_head_dim
    pool._init_data_ptrs_and_strides()


def rebuild_model_for_current_tp(old: torch.nn.Module) -> torch.nn.Module:
    """A new module tree of `type(old)` built for the TP in the current runtime context (on the meta device,
    no weight memory), with `old`'s Parameter objects (already resharded in place) and buffers bound into it.
    Module attributes fixed at construction (heads per rank, q/kv sizes, partition sizes, vocab shard
    indices, logits gather flag, group handles) thereby come from SGLang's own constructors."""
    with torch.device("meta"):
        new = type(old)(config=old.config, quant_config=getattr(old, "quant_config", None))
    old_params = dict(old.named_parameters())
    old_buffers = dict(old.named_buffers())
    for name, p in list(new.named_parameters()):
        src = old_params[name]
        if tuple(src.shape) != tuple(p.shape):
            raise RuntimeError(f"{name}: resharded shape {tuple(src.shape)} != new module's {tuple(p.shape)}")
        mod, _, leaf = name.rpartition(".")
        new.get_submodule(mod)._parameters[leaf] = src
    for name, b in list(new.named_buffers()):
        src = old_buffers[name]
        if tuple(src.shape) != tuple(b.shape):
            raise RuntimeError(f"buffer {name}: {tuple(src.shape)} != {tuple(b.shape)}")
        mod, _, leaf = name.rpartition(".")
        new.get_submodule(mod)._buffers[leaf] = src
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


def pat_regroup_grow(self, path: str) -> None:
    """TP=1 replicas on every WORLD rank -> one TP=world group, in place, in this process.

    1. reshard the live Parameters in place with pat_rollout's plan (grow by merge: rank r keeps its slice),
    2. rebuild the module tree for the TP=world context (SGLang's own TP group `_TP`, created at start-up
       and never destroyed) and bind the same Parameter objects into it,
    3. swap `model_runner.model`. Writes identity facts to `path.rank{r}.pt`."""
    from sglang.srt.distributed.parallel_state import get_world_group

    world = get_world_group()
    rank, size = world.rank_in_group, world.world_size
    tp_rank, tp_size = _tp(self)
    if (tp_rank, tp_size) != (rank, size):
        raise RuntimeError(f"expected TP group == WORLD, got tp {tp_rank}/{tp_size}, world {rank}/{size}")
    runner = self.tp_worker.model_runner
    old = runner.model
    src = Layout(tuple((d,) for d in range(size)))
    dst = plan_layout(src, size)
    specs = sglang_specs(_hf_config_dict(self), int(old.model.embed_tokens.num_embeddings_padded))
    named = dict(old.named_parameters())
    specs = {n: s for n, s in specs.items() if n in named}
    plan = plan_weights(src, dst, specs)
    sharded = {n: named[n] for n in specs if specs[n].dim is not None}
    with torch.no_grad():
        out = reshard_local(sharded, plan, rank, LocalOnlyTransport(rank))
        new = rebuild_model_for_current_tp(old)
    new_params = dict(new.named_parameters())
    rb = getattr(self, "running_batch", None)
    running = [len(r.output_ids) for r in (getattr(rb, "reqs", None) or [])]  # requests whose KV is kept
    runner.model = new
    if getattr(runner, "_pat_tp1", False):  # KV pool and forward were TP=1 too: slice KV heads, leave the patch
        from pat_rollout.layout.shard import kv_heads_for_rank

        total_kv = int(_hf_config_dict(self).get("num_key_value_heads"))
        lo, hi = kv_heads_for_rank(total_kv, dst.position(rank)[1], size)
        slice_kv_pool_heads(runner.token_to_kv_pool, lo, hi)
        runner._pat_tp1 = False
    torch.save(dict(same_object={n: out[n] is named[n] and new_params[n] is named[n] for n in sharded},
                    running_output_lens=running, kv_heads=int(runner.token_to_kv_pool.head_num),
                    new_rank=dst.position(rank)[1], num_moved=sum(1 for t in plan.transfers_for(rank)
                                                                  if not t.is_local)),
               f"{path}.rank{rank}.pt")


RPC_METHODS = {f.__name__: f for f in (pat_save_params, pat_reshard_in_place, pat_regroup_grow)}


def install() -> None:
    import os

    from sglang.srt.managers.scheduler import Scheduler

    for name, fn in RPC_METHODS.items():
        setattr(Scheduler, name, fn)
    if os.environ.get(BUILD_TP1_ENV) == "1":
        _wrap_load_model_tp1()
    elif os.environ.get(BUILD_TP1_ENV) == "serve":
        _wrap_runner_tp1()


def run_scheduler_process(*args: Any, **kwargs: Any) -> None:
    """SGLang's `run_scheduler_process` with pat_rollout's RPC methods installed first."""
    install()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    sglang_run(*args, **kwargs)
