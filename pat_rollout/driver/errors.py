"""The errors that cross the boundary between the driver and a backend's pool: the backends raise them, the
driver catches them. One module both sides import; it imports nothing of pat_rollout (no circles)."""

from __future__ import annotations

from collections.abc import Sequence


class WorkerError(RuntimeError):
    """A call to a device failed; `devices` names the devices involved. `unresponsive` is True when a
    device died or missed its deadline: its state is unknown, so the pool cannot be trusted any more."""

    def __init__(self, message: str, devices: Sequence[int], *, unresponsive: bool = False) -> None:
        super().__init__(message)
        self.devices = tuple(devices)
        self.unresponsive = unresponsive


class PoolBrokenError(RuntimeError):
    """The pool cannot serve any more (a device died or hung, or a rollback failed); the driver fails
    every request with this and refuses new ones at once."""


class ReconfigurationError(RuntimeError):
    """A reconfiguration failed; the pool was rolled back and no request was lost. `assignment`
    (request id -> replica of the base layout) says where each unfinished request runs now."""

    def __init__(self, message: str, assignment: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.assignment = dict(assignment or {})


class RebalanceError(ReconfigurationError):
    """A rebalance failed; every moved request was re-admitted on its source replica, so `assignment` is the
    assignment before the rebalance."""
