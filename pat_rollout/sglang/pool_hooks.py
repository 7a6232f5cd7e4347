"""Scheduler-process side of `SglPool`: the N ranks of one SGLang engine serve as the replicas of a PAT layout.

Installed by `scheduler_hooks.run_scheduler_process` when `PAT_SGLANG_POOL` holds the pool's JSON
(`{"base": groups, "layouts": {tp: groups}, "stack_dir": dir}`, device ids = WORLD ranks; stack dumps
on `STACK_DUMP_SIGNAL` go to `stack_dir`). What changes in SGLang's scheduler:

- groups: one `GroupCoordinator` per layout whose TP is not the WORLD's, created once at start-up (a collective
  over the WORLD) and never destroyed; the WORLD-sized layout uses SGLang's own TP group;
- build: model, KV pool and attention backend are built under the base layout's group
  (`patch_tensor_parallel_group`), so each rank of a 2xTP1 pool holds a TP=1 replica (full weights, all KV heads);
- forward: every forward runs under the current layout's group;
- input: WORLD rank 0 still reads every request, but routes it instead of broadcasting it over the WORLD: a
  generate request to the leader of the replica its rid names, everything else to every leader; each leader
  broadcasts its share within its replica (`replica_input`). `PAT_SGLANG_PER_REPLICA_INPUT=0` falls back to
  SGLang's own broadcast to every rank (each rank keeps the generate requests whose rid names its replica), which
  runs the replicas in lockstep;
- output: the first rank of each replica sends its replica's outputs to the tokenizer manager (ranks other than 0
  get their own PUSH socket); control answers stay with WORLD rank 0 only.

Ranks of different replicas run different batches in event loops of their own; they meet only in the RPCs and
control requests every rank runs (in the same order). Only stdlib/torch/pat_rollout at import time.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import torch

from pat_rollout.sglang import compat, layout_comm, replica_input

POOL_ENV = "PAT_SGLANG_POOL"
# Per-replica input (`replica_input`) unless "0": then SGLang's own broadcast over the whole pool (lockstep), kept
# as a fallback; both paths are tested (test_sglang_pool_kv_room).
REPLICA_INPUT_ENV = "PAT_SGLANG_PER_REPLICA_INPUT"


@dataclass(slots=True)
class PoolState:
    """This rank's view of the pool. `groups` is the current layout (tuples of WORLD ranks, TP-rank order)."""

    rank: int
    world: int
    base: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    layouts: dict[int, tuple[tuple[int, ...], ...]]
    coordinators: dict[int, Any] = field(default_factory=dict)  # tp -> GroupCoordinator (tp != world)
    models: dict[int, Any] = field(default_factory=dict)  # tp -> the module tree built for it (pool_switch._rebuild)
    graphs: dict[int, Any] = field(default_factory=dict)  # tp -> layout_graphs.LayoutGraphs (graphs on only)
    backup: dict[str, torch.Tensor] | None = None  # host copy of the base layout's params (rollback)
    backups: int = 0  # pat_backup_base calls so far (one at start-up, then one per weight sync)
    fail_next: tuple[str, int | None, float] | None = None  # tests: (phase, rank or None = all, hang_s)
    transport_group: Any = None  # pat_rollout's gloo group for KV / weight transfers (pool_switch._transport)
    per_replica_input: bool = True  # REPLICA_INPUT_ENV
    switches: int = 0  # pat_switch / pat_restore_base calls so far (every rank runs each): seeds the sampler RNG

    @property
    def tp(self) -> int:
        return len(self.groups[0])

    @property
    def replica(self) -> int:
        return next(i for i, g in enumerate(self.groups) if self.rank in g)

    @property
    def is_leader(self) -> bool:
        return self.groups[self.replica][0] == self.rank

    def coordinator(self, tp: int | None = None):
        """The cached group for TP `tp` (current by default); None for the WORLD's TP (SGLang's own `_TP`)."""
        tp = self.tp if tp is None else tp
        return None if tp == self.world else self.coordinators[tp]


STATE: PoolState | None = None


def tp_context(tp: int | None = None):
    """Run under the layout of TP `tp` (current by default): SGLang's `patch_tensor_parallel_group` with the
    cached group (TP and attention TP), or nothing for the WORLD-sized layout."""
    coord = STATE.coordinator(tp)
    return contextlib.nullcontext() if coord is None else compat.tp_group_patch(coord)


def _build_groups(state: PoolState) -> None:
    """Every rank calls this at the same point (inside start-up): one new group per non-WORLD layout."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_world_group, init_model_parallel_group

    if state.coordinators:
        return
    world = get_world_group()
    backend = dist.get_backend(world.device_group)
    # On GPUs (NCCL) the cached groups get the communicators SGLang's own TP group gets (pynccl, custom all-reduce:
    # SGLang's defaults, None), which CUDA graph capture and replay use; untested on a GPU. Elsewhere none.
    # Made eagerly and measured, before the KV pool is sized (layout_comm, issue #35).
    with layout_comm.measured():  # --- layout_comm (#35)
        for tp, groups in sorted(state.layouts.items()):
            if tp == state.world:
                continue
            use_pynccl, use_car = layout_comm.comm_flags(backend, tp, len(state.base[0]))  # --- layout_comm (#35)
            state.coordinators[tp] = init_model_parallel_group(
                [list(g) for g in groups], world.local_rank, backend, use_pynccl=use_pynccl,
                use_custom_allreduce=use_car, group_name=f"pat_tp{tp}")
        layout_comm.warm_up(state)  # --- layout_comm (#35)


class _LeaderSender:
    """SGLang's `SenderWrapper` interface; sends only while this rank leads its replica."""

    def __init__(self, socket) -> None:
        self.socket = socket

    def send_output(self, output, recv_obj=None) -> None:
        if STATE is not None and STATE.is_leader and self.socket is not None:
            compat.sender_wrapper_cls()(self.socket).send_output(output, recv_obj)


def _install_output_path() -> None:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.utils.network import get_zmq_socket

    orig_init = Scheduler.init_ipc_channels

    def init_ipc_channels(self, port_args) -> None:
        orig_init(self, port_args)
        if not self.skip_tokenizer_init:
            raise RuntimeError("SglPool needs skip_tokenizer_init=True (outputs go straight to the tokenizer side)")
        if STATE.per_replica_input:
            replica_input.open_sockets(STATE, port_args.scheduler_input_ipc_name)
        if STATE.rank == 0:  # rank 0 always leads its replica (groups are sorted): SGLang's own sockets stay
            return
        import zmq

        sock = get_zmq_socket(zmq.Context(1), zmq.PUSH, port_args.tokenizer_ipc_name, False)
        self._pat_sender = _LeaderSender(sock)
        compat.install_output_sockets(self, self._pat_sender)

    Scheduler.init_ipc_channels = init_ipc_channels
    compat.route_abort_outputs(Scheduler)  # aborts of queued requests, too, leave through the rank's sender


def _install_routing() -> None:
    """Fallback input path (`PAT_SGLANG_PER_REPLICA_INPUT=0`): SGLang's broadcast of every request to every rank;
    each rank keeps the generate requests
    whose rid names its replica (aborts and control requests reach every rank)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler

    orig = Scheduler.process_input_requests

    def process_input_requests(self, recv_reqs):
        mine = STATE.replica
        keep = [r for r in recv_reqs if not isinstance(r, TokenizedGenerateReqInput)
                or (replica_input.replica_of_rid(r.rid) or 0) == mine]
        return orig(self, keep)

    Scheduler.process_input_requests = process_input_requests


def _install_input_path() -> None:
    if not STATE.per_replica_input:
        _install_routing()
        return
    compat.install_replica_input(lambda pull_raw: replica_input.leader_share(STATE, pull_raw),
                                 lambda reqs: replica_input.replica_broadcast(STATE, reqs),
                                 lambda reqs: replica_input.send_to_other_leaders(STATE, reqs))


def _install_idle_sleep() -> None:
    """An idle rank sleeps until its input arrives instead of spinning (replica_input.sleep_until_input)."""
    from sglang.srt.managers.scheduler import Scheduler

    def maybe_sleep_on_idle(self) -> None:
        replica_input.sleep_until_input(STATE, lambda: compat.input_sockets(self))

    Scheduler.maybe_sleep_on_idle = maybe_sleep_on_idle


def _install_build_and_forward() -> None:
    from sglang.srt.managers.tp_worker import TpModelWorker

    def under_base(orig):
        def run(self, *a, **kw):
            _build_groups(STATE)
            with tp_context():
                return orig(self, *a, **kw)
        return run

    # Model, KV pools and attention backends are built for the base layout; the scheduler's own groups
    # (request broadcast, barriers) stay SGLang's WORLD-sized TP group.
    for cls, name in compat.build_methods():
        setattr(cls, name, under_base(getattr(cls, name)))
    orig_fwd = TpModelWorker.forward_batch_generation
    update_cls, update_name = compat.weight_update_method()
    orig_update = getattr(update_cls, update_name)

    def forward_batch_generation(self, *a, **kw):
        with tp_context():
            return orig_fwd(self, *a, **kw)

    def update_weights_from_tensor(self, *a, **kw):  # weight loaders shard for the current layout
        with tp_context():
            return orig_update(self, *a, **kw)

    TpModelWorker.forward_batch_generation = forward_batch_generation
    setattr(update_cls, update_name, update_weights_from_tensor)


def install() -> bool:
    """Set up this scheduler process as a pool rank if `PAT_SGLANG_POOL` is set; returns whether it was."""
    global STATE
    raw = os.environ.get(POOL_ENV)
    if not raw:
        return False
    cfg = json.loads(raw)
    layouts = {int(tp): tuple(tuple(g) for g in groups) for tp, groups in cfg["layouts"].items()}
    base = tuple(tuple(g) for g in cfg["base"])
    world = sum(len(g) for g in base)
    # Which WORLD rank this process is: set by SGLang before the scheduler runs, read lazily.
    STATE = PoolState(rank=-1, world=world, base=base, groups=base, layouts=layouts,
                      per_replica_input=os.environ.get(REPLICA_INPUT_ENV, "1") != "0")
    if cfg.get("stack_dir"):
        _register_stack_dump(cfg["stack_dir"])
    _install_output_path()
    _install_input_path()
    _install_idle_sleep()
    _install_build_and_forward()
    return True


STACK_DUMP_SIGNAL = signal.SIGUSR1  # SglPool sends it to every scheduler when an RPC misses its deadline
_stack_file = None  # kept open for faulthandler


def stack_dump_path(stack_dir: str, pid: int) -> str:
    return os.path.join(stack_dir, f"stacks.{pid}.txt")


def _register_stack_dump(stack_dir: str) -> None:
    """On `STACK_DUMP_SIGNAL` faulthandler writes every thread's stack to this process's own file (one file per
    rank: dumps of several ranks on one stderr interleave) and the process goes on."""
    global _stack_file
    _stack_file = open(stack_dump_path(stack_dir, os.getpid()), "w")
    faulthandler.register(STACK_DUMP_SIGNAL, file=_stack_file, all_threads=True)


def set_rank(rank: int) -> None:
    STATE.rank = rank
