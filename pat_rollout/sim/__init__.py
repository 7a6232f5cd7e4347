"""Simulation of one synchronous generation stage: an independent ground truth (step times, KV capacity,
admission/preemption, prefill, driver loop, reconfiguration phases: `hardware`, `replica`, `simulator`), policies
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
