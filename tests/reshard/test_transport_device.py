"""Transports by device: no non-CPU tensor ever reaches a gloo group (GlooTransport checks it), device tensors go
through pinned-host staging (StagedTransport), and `transport_for` picks by device. Two real gloo processes; the
device path with real CUDA tensors is tests/gpu/test_transport_gpu.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pat_rollout.comm.transport import (
    GlooTransport,
    LoopbackMailbox,
    LoopbackTransport,
    StagedTransport,
    check_cpu,
    transport_for,
)


class _StageAll(StagedTransport):
    """Stages CPU tensors too: the staging path (copy at submit, copy back after run) without a device."""

    def stages(self, tensor: torch.Tensor) -> bool:
        return True


def test_check_cpu_names_the_tensor_and_the_way_out():
    check_cpu(torch.ones(2), "ok")
    with pytest.raises(TypeError, match=r"KV send: a meta tensor \(3,\) torch.float16 cannot go through a gloo group"
                                        r".*StagedTransport"):
        check_cpu(torch.empty(3, dtype=torch.float16, device="meta"), "KV send")


def test_transport_for_picks_by_device():
    loop = LoopbackTransport(LoopbackMailbox(), 0)
    assert transport_for("cpu", loop) is loop
    staged = transport_for(torch.device("cuda", 0), loop)
    assert isinstance(staged, StagedTransport) and staged.inner is loop and staged.device == 0


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        gloo = GlooTransport(None)
        assert gloo.cpu_only
        # 1. a non-CPU tensor is refused at submit, before anything reaches gloo (send and receive)
        for submit in (gloo.submit_send, gloo.submit_recv):
            try:
                submit(torch.empty(4, device="meta"), 1 - rank, 0)
            except TypeError as e:
                assert "cannot go through a gloo group" in str(e), e
            else:
                raise AssertionError(f"{submit.__name__} accepted a meta tensor")
        assert not gloo._ops
        # 2. staging: the sender may overwrite its tensor right after submitting; the receiver's tensor is filled
        # from the host buffer when run() returns; the inner gloo transport only ever sees CPU tensors
        staged = _StageAll(gloo, pin=False)
        mine = torch.arange(6, dtype=torch.float32) + 100 * rank
        got = torch.zeros(6)
        staged.submit_send(mine, 1 - rank, 7)
        mine.fill_(-1)
        staged.submit_recv(got, 1 - rank, 7)
        assert got.sum() == 0  # not before run()
        staged.run()
        assert staged.staged_bytes == 2 * 6 * 4
        torch.save(got, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_gloo_refuses_device_tensors_and_staging_round_trip(tmp_path: Path) -> None:
    out = str(tmp_path / "got")
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in (0, 1):
        assert torch.equal(torch.load(f"{out}.{rank}"), torch.arange(6, dtype=torch.float32) + 100 * (1 - rank))
