"""Aborting device communicators, so that a peer blocked in a collective with a failed rank returns with an error.

A rank that fails (raises, dies, misses its deadline) while a peer sits inside a device collective with it leaves
that peer's stream blocked: a ProcessGroupNCCL collective waits for its watchdog timeout at best, a pynccl
collective (SGLang's graph-capture and in-graph all-reduce) has no timeout at all. NCCL's way out is
`ncclCommAbort` on the communicator, from any thread: every operation pending on it, on this rank, fails, and the
peers' operations on the same communicator fail once their proxies see the closed connections. So whoever sees the
failure aborts every communicator of the groups involved on every rank it can reach (`abort`).

Kinds of communicator a group may hold, and what aborting each does:
- "process_group": a torch ProcessGroup. NCCL: `distributed_c10d._abort_process_group` (thread-safe). Gloo has no
  abort in torch (the caller's gloo timeout bounds it; `GlooTransport.abort` closes a transport's pairs instead):
  reported as skipped.
- "pynccl": SGLang's `PyNcclCommunicator`: `ncclCommAbort(comm)` through the library SGLang loaded, then
  `disabled = True` so no later call enqueues on it.
- "custom_allreduce": SGLang's custom all-reduce (IPC buffers, spin-waiting kernels). It has no abort: a kernel
  spinning on a dead peer's flag is released only by the process exiting. Marked `disabled` (later all-reduces
  fall back to pynccl/NCCL, which are aborted) and reported as such.

Objects are duck-typed (SGLang's `GroupCoordinator` attributes `device_group`, `pynccl_comm`, `ca_comm`), so the
unit tests use fakes where no NCCL exists.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("process_group", "pynccl", "custom_allreduce")


@dataclass(frozen=True, slots=True)
class Communicator:
    kind: str  # one of KINDS
    name: str  # which group it belongs to, for the report
    obj: Any


def of_coordinator(name: str, coordinator: Any) -> list[Communicator]:
    """Every device communicator an SGLang `GroupCoordinator` (or a look-alike) holds: its device ProcessGroup,
    pynccl communicator and custom all-reduce, the ones it has."""
    out = []
    for attr, kind in (("pynccl_comm", "pynccl"), ("ca_comm", "custom_allreduce"), ("device_group", "process_group")):
        obj = getattr(coordinator, attr, None)
        if obj is not None:
            out.append(Communicator(kind, name, obj))
    return out


def abort(comms: Iterable[Communicator]) -> list[str]:
    """Abort each communicator (in-graph ones first: pynccl, custom all-reduce, then the process groups); never
    raises. Returns one line per communicator saying what happened, for the error message and the log."""
    order = {k: i for i, k in enumerate(KINDS[1:] + KINDS[:1])}
    lines = []
    for c in sorted(comms, key=lambda c: order[c.kind]):
        try:
            what = _ABORTS[c.kind](c.obj)
        except Exception as e:  # an abort that fails must not hide the others
            what = f"abort failed: {type(e).__name__}: {e}"
        lines.append(f"{c.name}/{c.kind}: {what}")
    if lines:
        logger.warning("aborted communicators: %s", "; ".join(lines))
    return lines


def _backend(pg: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(pg))


def _abort_process_group(pg: Any) -> None:
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(pg)


def _abort_pg(pg: Any) -> str:
    backend = _backend(pg)
    if backend != "nccl":
        return f"skipped ({backend}: no abort in torch; its timeout bounds the wait)"
    _abort_process_group(pg)
    return "aborted (ProcessGroupNCCL)"


def _abort_pynccl(comm: Any) -> str:
    if getattr(comm, "disabled", False) and not getattr(comm, "available", True):
        return "skipped (never initialised)"
    comm.disabled = True  # first: nothing new is enqueued on it while it is aborted
    fn = comm.nccl.lib.ncclCommAbort
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
    rc = fn(comm.comm)
    return "aborted (ncclCommAbort)" if rc == 0 else f"ncclCommAbort returned {rc}"


def _disable_custom_allreduce(ca: Any) -> str:
    ca.disabled = True
    return "disabled (no abort exists: a kernel spinning on a dead peer ends with the process)"


_ABORTS = {"process_group": _abort_pg, "pynccl": _abort_pynccl, "custom_allreduce": _disable_custom_allreduce}
