"""Errors of calls to devices, shared by the pools, the reconfigurer and the driver (no imports: no circles)."""

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
