"""Debug hook inside SglPool scheduler processes: a log of the token ids every rank sampled, per batch.

Enabled by `PAT_SGLANG_SAMPLED_LOG=<dir>` in the environment the scheduler processes start with; off otherwise
(nothing is patched). Each rank appends one JSON line per batch result to `<dir>/sampled.<pid>.rank<r>.jsonl`:
`{"switches", "tp", "replica", "mode", "rids", "ids"}`. The ranks of one replica run the same batches in the
same order, so their lines for a layout must be equal; `read_sampled_logs` gathers them for a test. Writing
forces a device sync per batch: tests only. Only stdlib at import time (sglang is imported by `install`).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from pat_rollout.sglang import pool_hooks

LOG_ENV = "PAT_SGLANG_SAMPLED_LOG"


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


def install() -> bool:
    """Patch `Scheduler.process_batch_result` to log each batch's sampled ids, if `PAT_SGLANG_SAMPLED_LOG` is set."""
    if not os.environ.get(LOG_ENV) or pool_hooks.STATE is None:
        return False
    from sglang.srt.managers.scheduler import Scheduler

    orig = Scheduler.process_batch_result

    def process_batch_result(self, batch, result, *a: Any, **kw: Any):
        _record(self, batch, result)
        return orig(self, batch, result, *a, **kw)

    Scheduler.process_batch_result = process_batch_result
    return True


def read_sampled_logs(log_dir: str) -> dict[int, list[dict[str, Any]]]:
    """WORLD rank -> that rank's logged batches in order. One pool per directory: ranks are not told apart
    by pool."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "sampled.*.rank*.jsonl"))):
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
