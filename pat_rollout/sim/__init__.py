"""Simulation of one synchronous generation stage: response-length traces and a discrete-event simulator that
compares static TP, the PAT planner and an oracle on a latency profile.

Pure stdlib plus pat_rollout.planner and pat_rollout.profile.model (no torch, ray or sglang).
"""

from pat_rollout.sim.compare import compare, format_table, ratios
from pat_rollout.sim.simulator import SimResult, simulate_oracle, simulate_pat, simulate_static
from pat_rollout.sim.traces import Trace, TraceRecord, deepscaler_like, read_trace, uniform_trace, verl_like

__all__ = [
    "SimResult", "Trace", "TraceRecord", "compare", "deepscaler_like", "format_table", "ratios", "read_trace",
    "simulate_oracle", "simulate_pat", "simulate_static", "uniform_trace", "verl_like",
]
