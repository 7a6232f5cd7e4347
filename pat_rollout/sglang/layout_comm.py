"""The pool's device communicators on SGLang: which ones each layout gets, made eagerly at start-up and measured,
and aborted on every rank when one fails.

- Which: the pool builds one SGLang `GroupCoordinator` per layout whose TP is not the WORLD's (`pool_hooks.
  _build_groups`), only for the pool's TP sizes (`pool.pool_layouts`: candidate_tps and initial_tp). On NCCL each
  gets SGLang's defaults (a pynccl communicator and a custom all-reduce, both eager: about 0.7 GB per group by
  SGLang's own measurement, sgl-project/sglang#22515); `PatRolloutConfig.layout_custom_all_reduce=False` leaves the
  custom all-reduce out of the layouts other than the base one (env `CUSTOM_AR_ENV` in the schedulers).
- Eager and budgeted: the torch NCCL group of each layout (SGLang's own TP group for the WORLD-sized one) is warmed
  with one all-reduce right after the groups are made (`comm.device_groups.warm_up`), which happens inside the first
  start-up method, before SGLang loads the weights and sizes the KV pool: every communicator's memory is taken by
  then, so the KV pool is sized from what is left. `INFO["comm_bytes"]` is what they took on this GPU (free memory
  before - after); the driver logs it and keeps it as `SglPool.startup.comm_bytes_per_gpu` (`pat_comm_info`).
- Abort: a rank that fails around a device collective (a layout's first capture, `layout_graphs.on_switch_failure`),
  or the driver on a dead rank or a missed deadline (`request_abort`), drops a file `abort_path(workdir, tp)`; a
  watcher thread in every scheduler (`start_watcher`) aborts its own communicators of that layout (or of all) from
  outside the main thread, which may be blocked in the collective: NCCL needs every rank to abort its own
  communicator (a kernel spinning on a peer over NVLink is not released by the peer's abort). The main thread's
  collective then fails, so every rank returns with an error in bounded time (`comm.abort`). A layout whose
  communicators were aborted is refused afterwards (`check_usable`); the base's are aborted only with "all".
Only stdlib/torch/pat_rollout at import time.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from pat_rollout.comm import abort as comm_abort
from pat_rollout.comm import device_groups

logger = logging.getLogger(__name__)

CUSTOM_AR_ENV = "PAT_SGLANG_LAYOUT_CUSTOM_AR"  # "0": no custom all-reduce in the non-base layouts' groups
ABORT_PREFIX = "pat_abort."
ALL = "all"
POLL_S = 0.05

INFO: dict[str, Any] = {"comm_bytes": 0, "warmed_groups": 0, "custom_ar": {}}  # this rank, after start-up
ABORTED: dict[str, list[str]] = {}  # "tp2" / "all" -> what was aborted (this rank)


# ---- driver side -------------------------------------------------------------------------------------------------
def engine_env(layout_custom_all_reduce: bool) -> dict[str, str]:
    return {CUSTOM_AR_ENV: "1" if layout_custom_all_reduce else "0"}


def abort_path(workdir: str, tp: int | None) -> str:
    return os.path.join(workdir, ABORT_PREFIX + (ALL if tp is None else f"tp{tp}"))


def request_abort(workdir: str, reason: str, tp: int | None = None) -> None:
    """Ask every scheduler of the pool to abort its communicators of layout TP `tp` (None: all of them)."""
    if not workdir or not os.path.isdir(workdir):
        return
    path = abort_path(workdir, tp)
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(reason)
        os.replace(path + ".tmp", path)


# ---- scheduler side: making them -------------------------------------------------------------------------------
def comm_flags(backend: str, tp: int, base_tp: int) -> tuple[bool | None, bool | None]:
    """(use_pynccl, use_custom_allreduce) for the cached group of TP `tp`: SGLang's defaults (None) on NCCL, none
    elsewhere; no custom all-reduce for a non-base layout when the config turns it off."""
    if backend != "nccl":
        return False, False
    car = None if tp == base_tp or os.environ.get(CUSTOM_AR_ENV, "1") != "0" else False
    INFO["custom_ar"][tp] = car is None
    return None, car


def _device() -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


@contextlib.contextmanager
def measured() -> Iterator[None]:
    """Around the making of the groups and `warm_up`: their device bytes into INFO["comm_bytes"], logged."""
    out: dict[str, Any] = {}
    with device_groups.measured(_device(), out):
        yield
    INFO["comm_bytes"] = int(out["bytes"])
    logger.info("pat: layout communicators made at start-up: %.1f MiB on this GPU (%d NCCL groups warmed, custom "
                "all-reduce per TP %s), taken before the KV pool is sized", INFO["comm_bytes"] / 2**20,
                INFO["warmed_groups"], INFO["custom_ar"])


def layout_coordinators(state) -> dict[int, Any]:
    """TP -> the GroupCoordinator of each pool layout on this rank (SGLang's own TP group for the WORLD-sized)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    return {tp: state.coordinators[tp] if tp != state.world else get_tp_group() for tp in sorted(state.layouts)}


def warm_up(state) -> None:
    """Create every layout's torch NCCL communicator now (collective, the same order on every rank)."""
    device = _device()
    if device is None:
        return
    groups = [c.device_group for c in layout_coordinators(state).values() if c.world_size > 1]
    INFO["warmed_groups"] = device_groups.warm_up(groups, device)


# ---- scheduler side: aborting them -----------------------------------------------------------------------------
def abort_local(state, key: str) -> list[str]:
    """Abort this rank's communicators of layout `key` ("tp2") or of every layout and SGLang's WORLD group
    ("all"); once per key. Returns what was done."""
    if key in ABORTED:
        return ABORTED[key]
    from sglang.srt.distributed.parallel_state import get_world_group

    coords = layout_coordinators(state)
    if key == ALL:
        comms = [c for tp, co in coords.items() for c in comm_abort.of_coordinator(f"tp{tp}", co)]
        comms += comm_abort.of_coordinator("world", get_world_group())
        if getattr(state, "transport_group", None) is not None:  # the pool's own transfer group (NCCL: aborted too)
            comms.append(comm_abort.Communicator("process_group", "transport", state.transport_group))
    else:
        comms = comm_abort.of_coordinator(key, coords[int(key[2:])])
    lines = comm_abort.abort(comms)
    if any("aborted" in line for line in lines):  # gloo-only groups (CPU) stay usable: nothing was aborted
        ABORTED[key] = lines
    return lines


def check_usable(tp: int) -> None:
    for key in (ALL, f"tp{tp}"):
        if key in ABORTED:
            raise RuntimeError(f"layout TP{tp}: its device communicators were aborted after a failure "
                               f"({'; '.join(ABORTED[key])}); the layout cannot run again in this pool")


def start_watcher(state, workdir: str) -> threading.Thread | None:
    """A daemon thread that aborts this rank's communicators when an abort file appears in `workdir`."""
    if not workdir:
        return None

    def watch() -> None:
        seen: set[str] = set()
        stop = threading.Event()
        while not stop.wait(POLL_S):
            for path in sorted(glob.glob(os.path.join(workdir, ABORT_PREFIX + "*"))):
                key = os.path.basename(path)[len(ABORT_PREFIX):]
                if key.endswith(".tmp") or key in seen:
                    continue
                seen.add(key)
                try:
                    reason = open(path).read()
                except OSError:
                    reason = "?"
                logger.error("pat: rank %d aborts its communicators of %s: %s", state.rank, key, reason)
                try:
                    abort_local(state, key)
                except Exception:  # e.g. before the groups exist; the watcher goes on
                    logger.exception("pat: rank %d could not abort its communicators of %s", state.rank, key)

    t = threading.Thread(target=watch, name="pat-comm-abort", daemon=True)
    t.start()
    return t
