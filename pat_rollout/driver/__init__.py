"""The driver: schedules requests onto the replicas of a pool, runs the generation loop and lets the planner
reconfigure the pool while it runs. It knows no backend: it gets its pool from the backend registry
(`backends`, keyed by `config.backend`) and talks only to the `Pool` protocol (`pool`); the errors both sides
share are in `errors`. Imports no ray, no sglang and no backend package (workers/, sglang/).

    api.py           RolloutDriver: construction and the public, thread-safe API
    loop.py          the background loop: stages, dispatch, polls, aborts, failures
    switching.py     layout switches and rebalances (planned or manual), and what the planner learns from them
    planner_glue.py  profile and planner construction, the planner's snapshot of the pool, poll samples
    metrics.py       StageMetrics, the per-stage `pat/*` metrics
    pool.py          the Pool protocol and the results of its switches
    errors.py        WorkerError, PoolBrokenError, ReconfigurationError, RebalanceError
    backends.py      get_backend(name): a backend's model_spec() and build_pool()
"""


def __getattr__(name: str):  # lazy: a backend importing driver.errors or driver.pool does not load the driver
    if name == "RolloutDriver":
        from pat_rollout.driver.api import RolloutDriver

        return RolloutDriver
    raise AttributeError(name)


__all__ = ["RolloutDriver"]
