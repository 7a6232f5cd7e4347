"""Point-to-point transports behind one tiny interface, so executors never call torch.distributed.

Usage by an executor: submit every send and receive of a plan step (in task_id order), then `run()`
once; after `run()` returns, every receive buffer is filled. Messages are matched by
(src device, dst device, task_id); NCCL ignores tags and matches by order per peer pair, which holds
because both sides submit in task_id order.

Devices: gloo's send/recv pass the tensor's raw pointer to a socket (no staging; torch lists gloo send/recv on
GPU as unsupported), so `GlooTransport` over a gloo group refuses any tensor not on the CPU (`check_cpu`). Device
tensors go through `StagedTransport`: pinned host staging over the same gloo transport (why staging and not NCCL
point-to-point: see its docstring and docs/gpu.md). `transport_for` picks one by the tensors' device; it is the
one place a device transport plugs in.

Failing fast: a device that fails a transfer step calls `abort()`, which releases every peer blocked on it
at once; `TransferTimeout` bounds a step by the bytes it moves, for peers that never arrive at all.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch.distributed as dist


class Transport(ABC):
    """Submit point-to-point operations, then `run()` to execute and wait for all of them."""

    device: int

    @abstractmethod
    def submit_send(self, tensor: torch.Tensor, dst_device: int, task_id: int) -> None:
        """Queue sending `tensor` (contiguous; must stay alive and unchanged until `run()` returns)."""

    @abstractmethod
    def submit_recv(self, tensor: torch.Tensor, src_device: int, task_id: int) -> None:
        """Queue receiving into `tensor` (contiguous), filled when `run()` returns."""

    @abstractmethod
    def run(self) -> None:
        """Execute all queued operations and block until they complete."""

    def close(self) -> None:
        """Release resources; the transport must not be used afterwards."""

    def abort(self) -> None:
        """This device failed a transfer step: release every peer blocked on it now. The transport (and its
        group) must be rebuilt before the next step. Default: nothing to release."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferTimeout:
    """How long one `run()` waits for its messages: `floor_s + bytes moved / min_bytes_per_s`, at most `max_s`
    (the group's own timeout). The floor covers the skew between devices entering the same step (the
    driver starts each phase on all devices at once, after the previous one finished everywhere)."""

    floor_s: float = 5.0
    min_bytes_per_s: float = 100e6
    max_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("floor_s", "min_bytes_per_s", "max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"TransferTimeout.{name}={value!r} must be a finite number > 0")

    def seconds(self, nbytes: int) -> float:
        """The wait allowed for a step that sends and receives `nbytes` bytes in all."""
        return min(self.max_s, self.floor_s + nbytes / self.min_bytes_per_s)


class LoopbackMailbox:
    """Shared by the LoopbackTransports of one simulated cluster (one per device, often one thread each)."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._messages: dict[tuple[int, int, int], torch.Tensor] = {}
        self._cond = threading.Condition()

    def put(self, key: tuple[int, int, int], tensor: torch.Tensor) -> None:
        with self._cond:
            if key in self._messages:
                raise RuntimeError(f"loopback: duplicate message (src, dst, task_id)={key}")
            self._messages[key] = tensor
            self._cond.notify_all()

    def take(self, key: tuple[int, int, int]) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._messages, timeout=self.timeout_s):
                raise RuntimeError(f"loopback: no message (src, dst, task_id)={key} after {self.timeout_s} s")
            return self._messages.pop(key)

    def pending(self) -> list[tuple[int, int, int]]:
        with self._cond:
            return sorted(self._messages)


class LoopbackTransport(Transport):
    """Single-process transport for simulating many devices: sends are copied into a shared mailbox at
    submit time; `run()` waits (bounded) for every expected message. Run each simulated device in its
    own thread, or submit all devices' sends before any `run()`."""

    def __init__(self, mailbox: LoopbackMailbox, device: int) -> None:
        self.mailbox = mailbox
        self.device = device
        self._recvs: list[tuple[torch.Tensor, int, int]] = []
        self.num_sent = 0
        self.bytes_sent = 0

    def submit_send(self, tensor: torch.Tensor, dst_device: int, task_id: int) -> None:
        self.mailbox.put((self.device, dst_device, task_id), tensor.detach().clone())
        self.num_sent += 1
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def submit_recv(self, tensor: torch.Tensor, src_device: int, task_id: int) -> None:
        self._recvs.append((tensor, src_device, task_id))

    def run(self) -> None:
        recvs, self._recvs = self._recvs, []
        for tensor, src, task_id in recvs:
            msg = self.mailbox.take((src, self.device, task_id))
            if msg.shape != tensor.shape or msg.dtype != tensor.dtype:
                raise RuntimeError(
                    f"loopback: device {self.device} task_id={task_id} from {src}: expected "
                    f"{tuple(tensor.shape)} {tensor.dtype}, got {tuple(msg.shape)} {msg.dtype}"
                )
            tensor.copy_(msg)


def check_cpu(tensor: torch.Tensor, what: str) -> None:
    """The invariant of every gloo group in pat_rollout: only CPU tensors cross it."""
    if tensor.device.type != "cpu":
        raise TypeError(f"{what}: a {tensor.device} tensor {tuple(tensor.shape)} {tensor.dtype} cannot go through a "
                        "gloo group (gloo send/recv would read the raw device pointer); device tensors take "
                        "comm.transport.StagedTransport (transport_for picks it by device)")


class GlooTransport(Transport):
    """torch.distributed isend/irecv over `group` (gloo or NCCL), batched with batch_isend_irecv.

    Over a gloo group every tensor must be on the CPU (`check_cpu`, checked at submit): a device tensor is a
    TypeError naming it, never a socket write from a device pointer.

    `device_to_group_rank` maps plan device ids to ranks in `group` (None: device id == group rank for
    every rank of the group). Self-messages are matched locally
    by task_id. Tags carry task_id (gloo matches on them; NCCL matches by submission order).
    `timeout` bounds each `run()` by its bytes (None: the group's timeout alone).
    """

    def __init__(self, group: dist.ProcessGroup | None, device_to_group_rank: dict[int, int] | None = None, *,
                 timeout: TransferTimeout | None = None) -> None:
        import torch.distributed as dist

        self.group = group
        self.timeout = timeout
        if device_to_group_rank is None:
            device_to_group_rank = {r: r for r in range(dist.get_world_size(group))}
        self.device_to_group_rank = dict(device_to_group_rank)
        my_rank = dist.get_rank(group)
        mine = [d for d, r in self.device_to_group_rank.items() if r == my_rank]
        if len(mine) != 1:
            raise RuntimeError(f"group rank {my_rank} maps to devices {mine} in {self.device_to_group_rank}")
        self.device = mine[0]
        self.cpu_only = dist.get_backend(group) == "gloo"
        self._ops: list[tuple[str, torch.Tensor, int, int]] = []
        self._local: dict[int, torch.Tensor] = {}

    def submit_send(self, tensor: torch.Tensor, dst_device: int, task_id: int) -> None:
        if self.cpu_only:
            check_cpu(tensor, f"GlooTransport send (device {self.device} -> {dst_device}, task_id={task_id})")
        if dst_device == self.device:
            self._local[task_id] = tensor
        else:
            self._ops.append(("send", tensor, dst_device, task_id))

    def submit_recv(self, tensor: torch.Tensor, src_device: int, task_id: int) -> None:
        if self.cpu_only:
            check_cpu(tensor, f"GlooTransport recv (device {self.device} <- {src_device}, task_id={task_id})")
        self._ops.append(("recv", tensor, src_device, task_id))

    def run(self) -> None:
        import torch.distributed as dist

        ops, self._ops = self._ops, []
        local, self._local = self._local, {}
        p2p = []
        for kind, tensor, peer, task_id in ops:
            if kind == "recv" and peer == self.device:
                if task_id not in local:
                    raise RuntimeError(f"device {self.device}: self-receive task_id={task_id} has no matching send")
                tensor.copy_(local.pop(task_id))
                continue
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, tensor, group=self.group, tag=task_id,
                                  group_peer=self.device_to_group_rank[peer]))
        if local:
            raise RuntimeError(f"device {self.device}: self-sends without receive, task_ids {sorted(local)}")
        if not p2p:
            return
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in p2p)
        limit_s = None if self.timeout is None else self.timeout.seconds(nbytes)
        t0 = time.monotonic()
        try:
            for work in dist.batch_isend_irecv(p2p):
                if limit_s is None:
                    work.wait()
                else:  # Work.wait(timeout) is a per-operation timeout on gloo and NCCL alike
                    left = max(0.001, limit_s - (time.monotonic() - t0))
                    work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as e:
            peers = sorted({peer for kind, _, peer, _ in ops if peer != self.device})
            tags = [op.tag for op in p2p]
            limit = "the group's timeout" if limit_s is None else f"{limit_s:.1f} s for {nbytes} bytes"
            raise RuntimeError(
                f"device {self.device}: transfer of {len(p2p)} p2p ops (task_ids {min(tags)}..{max(tags)}) with "
                f"devices {peers} failed after {time.monotonic() - t0:.1f} s (limit {limit}): {e}") from e

    def abort(self) -> None:
        """Close this device's connections in the group, so every peer blocked on it fails at once.

        torch does not expose cancelling a blocked gloo transfer (Work.abort is not bound in Python, and
        ProcessGroupGloo has no abort()), but a gloo receive that times out closes every pair of its
        context on both ends ("Application timeout caused pair closure" here, "Connection closed by peer"
        on the other side). So post a receive nobody sends and let it time out at once. NCCL would use
        torch.distributed.distributed_c10d._abort_process_group on each blocked peer instead (thread-safe there).
        """
        import torch.distributed as dist

        my_rank = dist.get_rank(self.group)
        peers = [r for r in self.device_to_group_rank.values() if r != my_rank]
        if not peers:
            return
        try:
            work = dist.irecv(torch.empty(1), group=self.group, group_src=peers[0], tag=_ABORT_TAG)
            work.wait(timeout=datetime.timedelta(milliseconds=1))
        except RuntimeError:  # the expected timeout, or pairs a peer already closed
            pass

    def close(self) -> None:
        self._ops.clear()
        self._local.clear()


class StagedTransport(Transport):
    """Device tensors over a CPU transport (gloo) through pinned host memory: a send is copied to the host when
    submitted (so the caller may overwrite the device tensor right after), a receive lands in a host buffer and
    is copied into the device tensor when `run()` returns. CPU tensors pass straight through.

    Why staging and not NCCL point-to-point on a device group (SGLANG_GPU_REVIEW item 1, docs/gpu.md):
    - memory: the first NCCL P2P between each pair of peers allocates per-peer channel buffers on the GPU (+GBs per
      GPU after an all-to-all pattern, NVIDIA/nccl#1685), after SGLang has sized its KV pool to fill memory; staging
      allocates no device memory beyond the caller's tensors (host: what is in flight, bounded by the callers'
      chunks);
    - failure: a blocked gloo transfer is released by `GlooTransport.abort` and bounded by `TransferTimeout`; an
      NCCL `Work.wait(timeout)` is not released that way and its watchdog tears the process down;
    - matching by (peer, tag) works as on CPU (NCCL ignores tags).
    The cost is bandwidth: device-to-host + host-to-device copies and TCP instead of NVLink. The pool moves at most
    one weight shrink and the migrated KV per switch, in bounded chunks; a faster device path (NCCL on a device
    group made at start-up) plugs in at `transport_for`.
    """

    def __init__(self, inner: Transport, *, pin: bool | None = None) -> None:
        self.inner = inner
        self.device = inner.device
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.staged_bytes = 0  # host bytes staged by the last run() (tests, logs)
        self._staged = 0

    def _host(self, like: torch.Tensor) -> torch.Tensor:
        self._staged += like.numel() * like.element_size()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)

    def stages(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` goes through a host buffer (any non-CPU tensor)."""
        return tensor.device.type != "cpu"

    def submit_send(self, tensor: torch.Tensor, dst_device: int, task_id: int) -> None:
        if self.stages(tensor):
            host = self._host(tensor)
            host.copy_(tensor)  # synchronous from pageable or pinned: the device tensor may change afterwards
            tensor = host
        self.inner.submit_send(tensor, dst_device, task_id)

    def submit_recv(self, tensor: torch.Tensor, src_device: int, task_id: int) -> None:
        if self.stages(tensor):
            host = self._host(tensor)
            self._copy_back.append((tensor, host))
            tensor = host
        self.inner.submit_recv(tensor, src_device, task_id)

    def run(self) -> None:
        copy_back, self._copy_back = self._copy_back, []
        self.staged_bytes, self._staged = self._staged, 0
        self.inner.run()
        for dst, host in copy_back:
            dst.copy_(host)  # synchronous: the host buffer is free to go when run() returns

    def abort(self) -> None:
        self._copy_back.clear()
        self.inner.abort()

    def close(self) -> None:
        self._copy_back.clear()
        self.inner.close()


def transport_for(device: torch.device | str, cpu_transport: Transport) -> Transport:
    """The transport for tensors on `device`: `cpu_transport` (gloo) itself for CPU tensors, pinned-host staging
    over it for anything else. The one place a device transport (e.g. NCCL P2P on a device group created at
    start-up) would be chosen instead."""
    if torch.device(device).type == "cpu":
        return cpu_transport
    return StagedTransport(cpu_transport)


# Tag of abort()'s receive; plan task_ids are positions in a plan and stay far below it.
_ABORT_TAG = 2**30
