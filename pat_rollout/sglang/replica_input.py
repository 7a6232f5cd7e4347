"""Per-replica input of an SglPool: each replica's leader gets its own requests; only a replica's ranks synchronise.

SGLang reads requests on WORLD rank 0 and broadcasts them over its whole TP group (here: the whole pool) at the top
of every event-loop iteration, so the replicas of a layout would run in lockstep: a long prefill on one replica
would stall every other replica's decode. Instead:

- rank 0 still owns SGLang's sockets (the tokenizer manager's requests, the RPCs). Each iteration it routes what it
  read, in order: a generate request to the leader of the replica its rid names (`make_rid`); aborts,
  control requests and RPCs to every leader. Other leaders get their share over a ZMQ PUSH/PULL pair per rank
  (FIFO), one message per iteration;
- each leader broadcasts its share within its replica's CPU group (the cached `pat_tp{k}` group; nothing at TP1);
- rank 0 routes nothing after an RPC in the same iteration (a `pat_switch` changes who leads): the rest waits for
  its next iteration, which runs the new layout.

Every rank thus sees every control request and RPC in the same order, so the WORLD collectives inside them (the
RPC barrier, a switch's transfers, a weight update's barrier) pair up as before; between them the replicas' event
loops run independently. A request for a replica other than rank 0's reaches it when rank 0's loop next reads
(one rank-0 iteration late at most). Only stdlib/torch/pat_rollout at import time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

RID_PREFIX = "pat-r"
_pull_sock: Any = None  # this rank's PULL socket (ranks other than 0)
_push_socks: dict[int, Any] = {}  # rank 0: WORLD rank -> PUSH socket to it
_held: list[Any] = []  # rank 0: requests read after an RPC, routed at its next iteration


def make_rid(replica: int, unique: str) -> str:
    """Request id that routes to `replica`; fixed length per replica (SGLang aborts match rids by prefix)."""
    return f"{RID_PREFIX}{replica}-{unique}"


def replica_of_rid(rid: str) -> int | None:
    if not rid.startswith(RID_PREFIX):
        return None
    head, sep, _ = rid[len(RID_PREFIX):].partition("-")
    return int(head) if sep and head.isdigit() else None


def address(base: str, rank: int) -> str:
    """The ZMQ address rank `rank` reads its share on, next to the engine's own scheduler socket `base`."""
    return f"{base}-pat-in{rank}"


def open_sockets(st, base: str) -> None:
    """`st`: this rank's `pool_hooks.PoolState` (as in every function here). Inside `Scheduler.init_ipc_channels` of every rank: rank 0 connects a PUSH socket to every other rank (any
    of them may lead a replica in some layout), every other rank binds its PULL socket."""
    global _pull_sock
    import zmq

    ctx = zmq.Context.instance()
    if st.rank == 0:
        for r in range(1, st.world):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address(base, r))
            _push_socks[r] = sock
    else:
        _pull_sock = ctx.socket(zmq.PULL)
        _pull_sock.setsockopt(zmq.LINGER, 0)
        _pull_sock.bind(address(base, st.rank))


def route(reqs: list[Any], groups: tuple[tuple[int, ...], ...]) -> tuple[dict[int, list[Any]], list[Any]]:
    """Split `reqs` (in the order read) into each replica leader's share under layout `groups`: leader rank ->
    requests. Returns the shares and the requests held back (everything after the first RPC)."""
    from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput, RpcReqInput, TokenizedGenerateReqInput

    leaders = [g[0] for g in groups]
    shares: dict[int, list[Any]] = {leader: [] for leader in leaders}
    for i, req in enumerate(reqs):
        if isinstance(req, BatchTokenizedGenerateReqInput):
            for sub in req.batch:  # one by one: the batch may span replicas
                shares[leaders[_replica(sub.rid, len(leaders))]].append(sub)
        elif isinstance(req, TokenizedGenerateReqInput):
            shares[leaders[_replica(req.rid, len(leaders))]].append(req)
        else:  # aborts, control requests, RPCs: every leader, in this order
            for share in shares.values():
                share.append(req)
            if isinstance(req, RpcReqInput):
                return shares, list(reqs[i + 1:])
    return shares, []


def _replica(rid: str, num_replicas: int) -> int:
    replica = replica_of_rid(rid) or 0
    if replica >= num_replicas:
        raise RuntimeError(f"request {rid!r} names replica {replica}, but the layout has {num_replicas}")
    return replica


def leader_share(st, pull_raw: Callable[[], list[Any] | None]) -> list[Any] | None:
    """This rank's requests of this iteration if it leads its replica, None otherwise. On rank 0, `pull_raw` reads
    SGLang's sockets; its reads are routed and the other leaders' shares sent to them."""
    import zmq

    if st.rank == 0:
        shares, held = route(_held + list(pull_raw() or []), st.groups)
        _held[:] = held
        for leader, share in shares.items():
            if leader != 0 and share:
                _push_socks[leader].send_pyobj(share)
        return shares[0]
    got: list[Any] = []
    while True:
        try:
            got.extend(_pull_sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            break
    if not st.is_leader:
        if got:
            raise RuntimeError(f"SglPool rank {st.rank} does not lead a replica of {st.groups} but was sent "
                               f"{len(got)} requests: {[type(r).__name__ for r in got]}")
        return None
    return got


IDLE_POLL_MS = 100  # longest idle sleep between SGLang's idle housekeeping rounds; input wakes a rank at once
_idle_poller = None
IDLE_STATS = {"sleeps": 0, "slept_s": 0.0}  # this rank's idle sleeps so far (pat_pool_info reports them)


def sleep_until_input(st, sglang_sockets: Callable[[], list[Any]]) -> None:
    """`Scheduler.maybe_sleep_on_idle` of a pool rank (SGLang calls it only when the rank is fully idle): a rank that
    reads requests itself blocks until one arrives, at most IDLE_POLL_MS, instead of spinning a core. Rank 0 waits on
    SGLang's own sockets (`sglang_sockets()`: tokenizer and RPC), another replica leader on its pull socket, which
    carries everything rank 0 routes to it (requests, aborts, RPCs). A rank that follows its leader returns at once:
    it waits in its replica's broadcast, and its role changes with the layout (rank 1 leads in 2 x TP1, follows in
    1 x TP2), so the check is made at every call. Rank 0 holding requests read after an RPC does not sleep: they are
    routed at its next iteration. SGLang's own `sleep_on_idle` watches only rank 0's sockets, hence refused.
    Why it matters: an idle spinning rank takes a whole core from the driver, the trainer and the other ranks (on
    this 2-core CI machine, from the test that waits on it)."""
    global _idle_poller
    import zmq

    if st.rank == 0:
        if _held:
            return
    elif not (st.per_replica_input and st.is_leader):
        return
    if _idle_poller is None:
        _idle_poller = zmq.Poller()
        for sock in (sglang_sockets() if st.rank == 0 else [_pull_sock]):
            _idle_poller.register(sock, zmq.POLLIN)
    t0 = time.perf_counter()
    _idle_poller.poll(IDLE_POLL_MS)
    IDLE_STATS["sleeps"] += 1
    IDLE_STATS["slept_s"] += time.perf_counter() - t0


def send_to_other_leaders(st, reqs: list[Any]) -> None:
    """Rank 0: requests it made itself (SGLang's timeout aborts) go to every other leader too."""
    for group in st.groups:
        if group[0] != 0 and reqs:
            _push_socks[group[0]].send_pyobj(list(reqs))


def replica_broadcast(st, reqs: list[Any] | None) -> list[Any]:
    """The leader's share to every rank of its replica (over the replica's CPU group; nothing to do at TP1)."""
    if st.tp == 1:
        return reqs or []
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.utils import broadcast_pyobj

    coord = st.coordinator()
    group = (coord or get_world_group()).cpu_group
    return broadcast_pyobj(reqs, st.rank, group, src=st.groups[st.replica][0])
