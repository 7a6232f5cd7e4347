"""Engine protocol (base.py) and the plain-PyTorch reference engine (ref/).

An engine is one TP shard of one DP replica: every rank of a TP group receives the same calls in
the same order (SPMD) and runs an identical scheduler, so batches agree without broadcasts.
Engines never import ray; the Ray actor in workers/ wraps them.
"""

from pat_rollout.engine.base import Engine, EngineSnapshot, RunningInfo, StepResult

__all__ = ["Engine", "EngineSnapshot", "RunningInfo", "StepResult"]
