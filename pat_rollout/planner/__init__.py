"""The PAT planner: predicts remaining response lengths, estimates the rest of the stage under each action from its
calibrated profile (by default the closed-form drain estimate; with PlannerConfig.estimator="lookahead", a
lookahead that runs the engine's mechanics, engine_model, shared with the simulator), and decides whether to stay,
rebalance requests across replicas or regroup to another TP (saving > overhead, with hysteresis).

Pure: imports only the stdlib, pat_rollout.types and pat_rollout.profile.model (no torch, ray or sglang).
"""

from pat_rollout.planner.balance import assign_new, balance
from pat_rollout.planner.cost import TransitionCost, transition_cost
from pat_rollout.planner.engine_model import EngineReplica, EngineReq, SchedulerModel
from pat_rollout.planner.engine_spec import EngineSpec
from pat_rollout.planner.estimator import drain_s, replica_drain_s
from pat_rollout.planner.lookahead import Lookahead, LookaheadConfig
from pat_rollout.planner.policy import Option, Planner, PlannerConfig
from pat_rollout.planner.predictor import LengthPredictor, PredictorConfig
from pat_rollout.planner.rebalance import (
    Move,
    RebalanceCost,
    RebalanceOption,
    plan_moves,
    rebalance_cost,
    rebalance_option,
)
from pat_rollout.planner.state import ClusterState, Decision, ReplicaLoad, ReqProgress

__all__ = [
    "ClusterState", "Decision", "EngineReplica", "EngineReq", "EngineSpec", "LengthPredictor", "Lookahead",
    "LookaheadConfig", "SchedulerModel", "Move", "Option", "Planner", "PlannerConfig", "PredictorConfig",
    "RebalanceCost", "RebalanceOption", "ReplicaLoad", "ReqProgress", "TransitionCost", "assign_new", "balance",
    "drain_s", "plan_moves", "rebalance_cost", "rebalance_option", "replica_drain_s", "transition_cost",
]
