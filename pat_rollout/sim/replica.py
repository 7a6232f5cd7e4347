"""One simulated replica: the engine's mechanics of planner/engine_model.py (the one copy the planner's lookahead
also runs) fed with the simulator's truth (its step model, capacity and scheduler). Pure stdlib."""

from __future__ import annotations

from pat_rollout.planner.engine_model import EngineReplica, EngineReq
from pat_rollout.sim.hardware import SimHardware

SimReq = EngineReq  # a request of the stage; in the simulator `length` is its true final length


class Replica(EngineReplica):
    """Replica of TP size `tp` on the truth `hw`, with clock `t` (seconds)."""

    def __init__(self, hw: SimHardware, tp: int, t: float = 0.0) -> None:
        super().__init__(hw.step, hw.scheduler, hw.capacity(tp), tp, t)
        self.hw = hw
