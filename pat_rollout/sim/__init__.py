"""Simulation of one synchronous generation stage: a ground truth (step times, KV capacity, driver loop,
reconfiguration phases: `hardware`, `simulator`; admission/preemption/prefill are planner/engine_model.py's
mechanics, the one copy the planner's lookahead also runs, fed the truth by `replica`), policies
plugged in through PollView -> action (`policies`), traces and length files (`traces`, `lengths`).

Pure stdlib plus pat_rollout.planner, pat_rollout.kv.cost and pat_rollout.profile (no torch, ray or sglang).
"""

from pat_rollout.sim.hardware import DriverModel, ReconfigModel, SchedulerModel, SimHardware, gpu_hardware
from pat_rollout.sim.simulator import PollView, Rebalance, Reconfigure, Sim, SimResult
from pat_rollout.sim.traces import Trace, TraceRecord, deepscaler_like, read_trace, uniform_trace, verl_like

__all__ = [
    "DriverModel", "PollView", "ReconfigModel", "Rebalance", "Reconfigure", "SchedulerModel", "Sim", "SimHardware", "SimResult",
    "Trace", "TraceRecord", "deepscaler_like", "gpu_hardware", "read_trace", "uniform_trace", "verl_like",
]
