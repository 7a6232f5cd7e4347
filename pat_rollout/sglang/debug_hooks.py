"""Debug hooks inside SglPool scheduler processes: what every rank sampled, and when every rank ran a forward.

- `PAT_SGLANG_SAMPLED_LOG=<dir>`: each rank appends one JSON line per batch result to
  `<dir>/sampled.<pid>.rank<r>.jsonl`: `{"switches", "tp", "replica", "mode", "rids", "ids"}`. The ranks of one
  replica run the same batches in the same order, so their lines for a layout must be equal; `read_sampled_logs`
  gathers them for a test.
- `PAT_SGLANG_STEP_LOG=<dir>`: each rank appends one line per model forward to `<dir>/steps.<pid>.rank<r>.jsonl`:
  `{"t0", "t1", "mode", "tokens"}` (wall-clock start and end, extend/decode, input tokens); `read_step_logs`.

Off unless set in the environment the scheduler processes start with (nothing is patched then). Writing forces a
device sync per batch: tests only. Only stdlib at import time (sglang is imported by `install`).
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Any

from pat_rollout.sglang import pool_hooks

LOG_ENV = "PAT_SGLANG_SAMPLED_LOG"
STEP_LOG_ENV = "PAT_SGLANG_STEP_LOG"


def _record(self, batch, result) -> None:
    st = pool_hooks.STATE
    ids = getattr(result, "next_token_ids", None)
    if st is None or ids is None or not getattr(batch, "reqs", None):
        return
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    mode = "decode" if batch.forward_mode.is_decode() else "extend" if batch.forward_mode.is_extend() else "other"
    line = dict(switches=st.switches, tp=st.tp, replica=st.replica, mode=mode, rids=[r.rid for r in batch.reqs],
                ids=ids)
    with open(os.path.join(os.environ[LOG_ENV], f"sampled.{os.getpid()}.rank{st.rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def install() -> None:
    """Patch what the set variables ask for (`PAT_SGLANG_SAMPLED_LOG`, `PAT_SGLANG_STEP_LOG`) on a pool rank."""
    if pool_hooks.STATE is None:
        return
    if os.environ.get(LOG_ENV):
        from sglang.srt.managers.scheduler import Scheduler

        orig = Scheduler.process_batch_result

        def process_batch_result(self, batch, result, *a: Any, **kw: Any):
            _record(self, batch, result)
            return orig(self, batch, result, *a, **kw)

        Scheduler.process_batch_result = process_batch_result
    if os.environ.get(STEP_LOG_ENV):
        _install_step_log()


def _install_step_log() -> None:
    from sglang.srt.managers.tp_worker import TpModelWorker

    orig = TpModelWorker.forward_batch_generation

    def forward_batch_generation(self, batch, *a: Any, **kw: Any):
        t0 = time.time()
        out = orig(self, batch, *a, **kw)
        line = dict(t0=t0, t1=time.time(), mode="decode" if batch.forward_mode.is_decode() else
                    "extend" if batch.forward_mode.is_extend() else "other",
                    tokens=int(len(batch.input_ids)) if getattr(batch, "input_ids", None) is not None else None)
        path = os.path.join(os.environ[STEP_LOG_ENV], f"steps.{os.getpid()}.rank{pool_hooks.STATE.rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return out

    TpModelWorker.forward_batch_generation = forward_batch_generation


def read_step_logs(log_dir: str) -> dict[int, list[dict[str, Any]]]:
    """WORLD rank -> that rank's forwards in order (one pool per directory)."""
    return _read(log_dir, "steps")


def read_sampled_logs(log_dir: str) -> dict[int, list[dict[str, Any]]]:
    """WORLD rank -> that rank's logged batches in order. One pool per directory: ranks are not told apart
    by pool."""
    return _read(log_dir, "sampled")


def _read(log_dir: str, kind: str) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, f"{kind}.*.rank*.jsonl"))):
        rank = int(path.rsplit(".rank", 1)[1].split(".")[0])
        with open(path) as f:
            out.setdefault(rank, []).extend(json.loads(line) for line in f)
    return out


def replica_mismatches(logs: dict[int, list[dict[str, Any]]], tp: int) -> tuple[int, list[str]]:
    """Compare the batches the ranks of each replica logged while the layout had TP `tp`: (batches compared,
    one message per difference). Ranks of one replica must log the same rids and sampled ids, batch by batch."""
    groups: dict[tuple[int, int], dict[int, list[dict[str, Any]]]] = {}
    for rank, lines in logs.items():
        for line in lines:
            if line["tp"] == tp:
                groups.setdefault((line["switches"], line["replica"]), {}).setdefault(rank, []).append(line)
    compared, bad = 0, []
    for (switches, replica), by_rank in sorted(groups.items()):
        ranks = sorted(by_rank)
        if len(ranks) != tp:
            bad.append(f"switch {switches} replica {replica}: only ranks {ranks} logged batches")
            continue
        first = by_rank[ranks[0]]
        for r in ranks[1:]:
            other = by_rank[r]
            if len(other) != len(first):
                bad.append(f"switch {switches} replica {replica}: rank {ranks[0]} ran {len(first)} batches, "
                           f"rank {r} ran {len(other)}")
            for i, (a, b) in enumerate(zip(first, other)):
                if (a["rids"], a["ids"]) != (b["rids"], b["ids"]):
                    bad.append(f"switch {switches} replica {replica} batch {i} ({a['mode']}): rank {ranks[0]} "
                               f"sampled {a['ids']} for {a['rids']}, rank {r} sampled {b['ids']} for {b['rids']}")
        compared += len(first)
    return compared, bad
