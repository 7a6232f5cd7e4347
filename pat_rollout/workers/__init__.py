"""Ray actors (one per device, each holding one TP shard of an engine) and the driver that
groups them into layouts, drives generation and runs PAT's reconfiguration protocol.

Only this package and verl/ import ray.
"""


def __getattr__(name: str):  # lazy: importing the package must not start or import Ray
    if name == "RolloutDriver":
        from pat_rollout.workers.driver import RolloutDriver

        return RolloutDriver
    raise AttributeError(name)


__all__ = ["RolloutDriver"]
