"""The driver's old import path, kept for code written against it; the driver is `pat_rollout.driver`."""

from pat_rollout.driver.api import RolloutDriver

__all__ = ["RolloutDriver"]
