"""Failing fast in GlooTransport over real gloo processes: a transfer step waits floor + bytes / rate (not the
group's timeout) for a peer that never arrives, and a device that aborts releases a peer blocked on it at once.
Both leave the group's pairs closed (the pool rebuilds its groups after a failed transfer step)."""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pat_rollout.comm.transport import GlooTransport, TransferTimeout

GROUP_TIMEOUT_S = 120  # what a blocked peer waited before these mechanisms


def test_transfer_timeout_grows_with_bytes_above_the_floor_up_to_the_cap():
    t = TransferTimeout(floor_s=2.0, min_bytes_per_s=1e6, max_s=30.0)
    assert t.seconds(0) == 2.0
    assert t.seconds(3_000_000) == 5.0
    assert t.seconds(10**9) == 30.0


@pytest.mark.parametrize("name", ["floor_s", "min_bytes_per_s", "max_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True])
def test_transfer_timeout_rejects_bad_values(name, value):
    with pytest.raises(ValueError, match=f"TransferTimeout.{name}="):
        TransferTimeout(**{name: value})


def _worker(rank: int, store: str, case: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    floor_s = 1.0 if case == "timeout" else 60.0
    transport = GlooTransport(None, timeout=TransferTimeout(floor_s=floor_s, min_bytes_per_s=1e6,
                                                            max_s=GROUP_TIMEOUT_S))
    buf = torch.zeros(250_000)  # 1 MB: 1 s at 1e6 bytes/s on top of the floor
    dist.barrier()
    t0 = time.monotonic()
    if rank == 1:  # waits for device 0's message, which never comes
        transport.submit_recv(buf, 0, task_id=3)
        try:
            transport.run()
            message = "no error"
        except RuntimeError as e:
            message = str(e)
        Path(f"{out}.{rank}").write_text(f"{time.monotonic() - t0:.3f}\n{message}")
    elif case == "abort":  # device 0 failed its step: release device 1 instead of sending
        time.sleep(0.5)
        transport.abort()
    else:
        time.sleep(5)  # stays up past device 1's timeout


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["timeout", "abort"])
def test_blocked_peer_is_released_in_seconds(case: str, tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "out")
    mp.spawn(_worker, args=(str(tmp_path / "store"), case, out), nprocs=2, join=True)
    elapsed, message = Path(f"{out}.1").read_text().split("\n", 1)
    if case == "timeout":  # floor 1 s + 1 MB at 1 MB/s, not the group's 120 s
        assert re.search(r"device 1: transfer of 1 p2p ops \(task_ids 3\.\.3\) with devices \[0\] failed after .* s "
                         r"\(limit 2\.0 s for 1000000 bytes\): .*Timed out waiting \d+ms", message), message
        assert 1.5 < float(elapsed) < 30, elapsed
    else:  # the abort closes device 0's pairs: device 1 fails at once, long before its 61 s limit
        assert re.search(r"device 1: transfer of 1 p2p ops \(task_ids 3\.\.3\) with devices \[0\] failed after .* s "
                         r"\(limit 61\.0 s for 1000000 bytes\): .*Connection (closed|reset) by peer", message), message
        assert float(elapsed) < 30, elapsed
