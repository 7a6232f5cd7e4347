"""Start one Ray actor per device and call them with clear errors when an actor dies."""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray

from pat_rollout.driver.errors import WorkerError
from pat_rollout.workers.shard_worker import ShardWorker, WorkerInit

logger = logging.getLogger(__name__)

__all__ = ["WorkerError", "WorkerGroup"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """`num_devices` ShardWorker actors joined in one torch.distributed world (gloo on CPU)."""

    def __init__(self, inits: Sequence[WorkerInit] | None = None, *, num_cpus_per_worker: float = 1,
                 start_timeout_s: float = 300, default_timeout_s: float = 300, **init_kwargs: Any) -> None:
        self.default_timeout_s = default_timeout_s
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        if inits is None:
            world = init_kwargs.pop("world_size")
            method = self.new_init_method()
            inits = [WorkerInit(device=d, world_size=world, init_method=method, **init_kwargs) for d in range(world)]
        self.num_devices = len(inits)
        tag = uuid.uuid4().hex[:6]
        actor_cls = ray.remote(num_cpus=num_cpus_per_worker)(ShardWorker)
        self.actors = [
            actor_cls.options(name=f"pat-shard-{tag}-{i.device}", max_restarts=0).remote(i) for i in inits
        ]
        self.call(range(self.num_devices), "info", timeout=start_timeout_s, what="start-up")

    def call(self, devices: Sequence[int] | range, method: str, *args: Any, timeout: float | None = None,
             what: str | None = None) -> list[Any]:
        """Call `method(*args)` on `devices` concurrently and return results in device order."""
        return self.call_each({d: (method, args) for d in devices}, timeout=timeout, what=what or method)

    def call_each(self, calls: dict[int, tuple[str, tuple[Any, ...]]], *, timeout: float | None = None,
                  what: str = "call") -> list[Any]:
        """Concurrent calls, results in the order of `calls`. Every call shares one deadline (`timeout`
        seconds, default `default_timeout_s`: never unbounded). On failure every call is still waited for
        (bounded), so no device is left running a phase behind the caller's back, and one WorkerError names
        every failed device and the phase."""
        timeout = self.default_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        refs = {d: getattr(self.actors[d], m).remote(*a) for d, (m, a) in calls.items()}
        out, errors, failed, unresponsive, first = [], [], [], [], None
        for d, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
                continue
            except ray.exceptions.RayActorError as e:
                errors.append(f"device {d}'s actor died during {what}: {e}")
                unresponsive.append(d)
            except ray.exceptions.GetTimeoutError as e:
                errors.append(f"device {d} did not answer {what} within {timeout:.1f} s")
                unresponsive.append(d)
                first = first or e
            except ray.exceptions.RayTaskError as e:
                errors.append(f"device {d} failed in {what}: {e.cause!r}")
                first = first or e.cause
            failed.append(d)
            out.append(None)
        if errors:
            raise WorkerError("; ".join(errors), failed, unresponsive=bool(unresponsive)) from first
        return out

    @staticmethod
    def new_init_method() -> str:
        """A fresh torch.distributed rendezvous (the actors run on this host)."""
        return f"tcp://127.0.0.1:{_free_port()}"

    def kill(self, device: int) -> None:
        """Kill one actor (tests of dead-actor handling)."""
        ray.kill(self.actors[device], no_restart=True)

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []
