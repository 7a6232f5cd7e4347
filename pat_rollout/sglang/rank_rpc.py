"""Both ends of one SglPool RPC: every rank reports how it ended, the driver waits with a deadline.

SGLang's `collective_rpc` waits on a ZMQ socket with no timeout and returns rank 0's success only: a hung or
dead scheduler hangs the driver, and a rank other than 0 that fails is never seen. Here:
- scheduler side (`reporting`): every pat_* method writes `{status}.rank{r}.status.json` (ok, error, phase)
  when it ends, and `{status}.rank{r}.phase` when it enters a phase (`enter`), so a hung rank can be named
  with the phase it is stuck in;
- driver side (`call`): the RPC goes out on the engine's own RPC socket and the reply is polled in short slices;
  each slice checks that every scheduler process is alive, and the whole wait is bounded by the deadline
  (`PatRolloutConfig.rpc_deadline_s`, the reference pool's rule). Either failure is a `WorkerError` with
  `unresponsive=True` naming the call and the ranks, which the driver turns into a broken pool.

Only stdlib at import time (the scheduler imports it before SGLang's heavy modules).
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

from pat_rollout.driver.errors import WorkerError

STATUS_KW = "pat_status"  # the keyword every pat_* RPC gets: the path prefix of its status files
FAULT_PHASES = ("export", "kv", "reshard", "switch", "import")  # pat_switch phases a test can fail or hang in
AGREE_PHASE = "agree"  # pat_switch's last step: a rank here waits for the others (it is not the one that hangs)
_current: dict[str, Any] = {"status": None, "rank": None}


# ---- scheduler side ----------------------------------------------------------------------------------------
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def enter(phase: str) -> None:
    """Record that this rank entered `phase` of the running RPC (read by the driver when the RPC times out)."""
    if _current["status"] is not None:
        with open(f"{_current['status']}.rank{_current['rank']}.phase", "w") as f:
            f.write(phase)


def reporting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a Scheduler RPC method that writes its rank's status file; errors still propagate to SGLang
    (which logs them and reports rank 0's). An exception's `pat_phase` attribute names the phase it failed in."""

    @functools.wraps(fn)
    def wrapped(self, *args: Any, **kw: Any) -> Any:
        status = kw.pop(STATUS_KW, None)
        _current.update(status=status, rank=_rank())
        try:
            fn(self, *args, **kw)
        except BaseException as e:
            _write_status(status, ok=False, error=f"{type(e).__name__}: {e}", phase=getattr(e, "pat_phase", None))
            raise
        finally:
            _current.update(status=None)
        _write_status(status, ok=True, error=None, phase=None)

    return wrapped


def _write_status(status: str | None, **obj: Any) -> None:
    if status is not None:
        with open(f"{status}.rank{_rank()}.status.json", "w") as f:
            json.dump(obj, f)


# ---- driver side -------------------------------------------------------------------------------------------
def read_statuses(status: str, num_ranks: int) -> dict[int, dict]:
    """Rank -> its status (ok, error, phase) for the ranks that finished the RPC; a missing rank did not."""
    out = {}
    for r in range(num_ranks):
        p = f"{status}.rank{r}.status.json"
        if os.path.exists(p):
            with open(p) as f:
                out[r] = json.load(f)
    return out


def read_phase(status: str, rank: int) -> str | None:
    p = f"{status}.rank{rank}.phase"
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return f.read().strip() or None


def describe_failures(status: str, num_ranks: int) -> str:
    """One line per failed or unfinished rank: 'rank 1 in phase kv: RuntimeError: ...'."""
    statuses = read_statuses(status, num_ranks)
    parts = []
    for r in range(num_ranks):
        s = statuses.get(r)
        phase = (s or {}).get("phase") or read_phase(status, r)
        where = f" in phase {phase}" if phase else ""
        if s is None and phase == AGREE_PHASE:
            where += " (waiting for the other ranks)"
        if s is None:
            parts.append(f"rank {r}{where} did not finish")
        elif not s["ok"]:
            parts.append(f"rank {r} failed{where}: {s['error']}")
    return "; ".join(parts)


def call(sgl: Any, method: str, kw: dict[str, Any], *, status: str, num_ranks: int, deadline_s: float,
         check_alive: Callable[[str], None], on_deadline: Callable[[], None] = lambda: None,
         poll_s: float = 0.2) -> tuple[bool, str]:
    """Send `method(**kw)` to every scheduler on `sgl`'s RPC socket and wait for rank 0's reply (SGLang's own
    reply comes after every rank ran it and passed a CPU barrier). Returns (success, rank 0's message).
    `on_deadline` runs once the deadline passed, before the WorkerError (the pool asks for stack dumps)."""
    from sglang.srt.managers.io_struct import RpcReqInput, RpcReqOutput

    from pat_rollout.sglang import compat

    sock = sgl.send_to_rpc
    compat.rpc_send(sock, RpcReqInput(method=method, parameters={**kw, STATUS_KW: status}))
    t_end = time.monotonic() + deadline_s
    while not sock.poll(timeout=int(poll_s * 1000)):
        check_alive(f"RPC {method}")
        if time.monotonic() > t_end:
            statuses = read_statuses(status, num_ranks)
            late = [r for r in range(num_ranks) if r not in statuses] or list(range(num_ranks))
            late = [r for r in late if read_phase(status, r) != AGREE_PHASE] or late  # who the waiters wait for
            on_deadline()
            raise WorkerError(f"SglPool RPC {method} missed its deadline of {deadline_s:.1f} s "
                              f"(PatRolloutConfig.rpc_deadline_s): {describe_failures(status, num_ranks)}; "
                              f"scheduler rank(s) {late} hung", late, unresponsive=True)
    reply = compat.rpc_recv(sock)
    if not isinstance(reply, RpcReqOutput):
        raise RuntimeError(f"SglPool RPC {method}: unexpected reply {type(reply).__name__} on the RPC socket")
    return bool(reply.success), str(reply.message)


def is_gone(pid: int) -> bool:
    """Whether process `pid` died (exited, killed, or a zombie not yet reaped): the dead-process checks of SglPool
    and of a standalone SGLangEngine."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def child_failed(signum: int, frame: Any) -> None:
    """`ServerArgs.custom_sigquit_handler` of every engine pat_rollout launches (SglPool's and a standalone
    SGLangEngine's). SGLang's own handler SIGKILLs this whole process tree when a scheduler process fails (the
    child, or 0.5.23's subprocess watchdog, sends SIGQUIT): that would take the driver (verl's rollout worker, a
    test run) with it and lose the child's error. Here it is only logged: a failure during start-up raises from
    SGLang's Engine (it reads the schedulers' start-up pipes), a later one is found by the dead-process check
    in every bounded wait (`SglPool._check_alive`, `SGLangEngine` children check) and raised there."""
    import logging

    logging.getLogger(__name__).error("SIGQUIT from an SGLang child process (a scheduler failed); the engine "
                                      "reports it at its next wait")
