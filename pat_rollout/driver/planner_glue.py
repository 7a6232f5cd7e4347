"""Glue between the driver and the pure planner: profile loading, planner construction, and ClusterState /
PollSample from the driver's bookkeeping (the hand-off constants come from the same profile: kv.cost.handoff_cost)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

from pat_rollout.config import PatRolloutConfig
from pat_rollout.engine.base import EngineSnapshot, RunningInfo, StepResult
from pat_rollout.planner import ClusterState, EngineSpec, Planner, ReplicaLoad, ReqProgress
from pat_rollout.planner.calibration import PollSample
from pat_rollout.profile.model import BUILTIN_PROFILES, DATA_DIR, LatencyModel
from pat_rollout.types import ModelSpec, Request


def load_profile(config: PatRolloutConfig, default: str) -> LatencyModel:
    """config.profile_path (a file or a builtin name), else `default` (the backend's DEFAULT_PROFILE)."""
    name = config.profile_path or default
    if name in BUILTIN_PROFILES:
        return LatencyModel.from_json(DATA_DIR / BUILTIN_PROFILES[name])
    if (DATA_DIR / f"{name}.json").is_file():
        return LatencyModel.from_json(DATA_DIR / f"{name}.json")
    if not Path(name).is_file():
        raise ValueError(f"profile {name!r} is neither a file nor a builtin profile "
                         f"({sorted(BUILTIN_PROFILES)} or data/*.json); make one with `python -m pat_rollout.profile`")
    return LatencyModel.from_json(name)


def build_planner(config: PatRolloutConfig, spec: ModelSpec, model: LatencyModel) -> Planner:
    missing = [tp for tp in config.tp_sizes if tp not in model.tps]
    if missing:
        raise ValueError(f"profile {model.meta.get('model')!r} has no decode points for TP sizes {missing}; "
                         f"it covers {list(model.tps)}")
    return Planner(model, config.planner_config())


def prompt_key(prompt_token_ids: tuple[int, ...]) -> str:
    """Stable id of a prompt across RL iterations (history for the length predictor)."""
    return hashlib.blake2b(repr(prompt_token_ids).encode(), digest_size=8).hexdigest()


def replica_load(snap: EngineSnapshot) -> ReplicaLoad:
    """One replica's load as its engine's snapshot states it (KV blocks of one rank: every rank of a replica
    holds the same tokens, for its own KV heads)."""
    return ReplicaLoad(num_waiting=snap.num_waiting, num_running=len(snap.running),
                       kv_tokens_used=(snap.num_total_blocks - snap.num_free_blocks) * snap.block_size,
                       kv_tokens_capacity=snap.num_total_blocks * snap.block_size)


def cluster_state(step: int, num_devices: int, tp: int, requests: Mapping[str, Request],
                  progress: Mapping[str, RunningInfo], prompt_keys: Mapping[str, str],
                  assignment: Mapping[str, int] | None = None, *,
                  snapshots: Mapping[int, EngineSnapshot] | None = None,
                  reported_spec: EngineSpec | None = None,
                  entry_s: tuple[tuple[int, float], ...] = ()) -> ClusterState:
    """The planner's view of the pool; `prompt_keys` holds each request's `prompt_key`, computed once.
    `snapshots`: the last poll's snapshot of every replica it stepped (from a pool that reports its engines' load:
    Pool.reports_load), giving every replica's load (a replica not stepped held no request) and whether each
    request's KV is on its replica (running there) or it waits for (re-)prefill."""
    running = None if snapshots is None else {i.request_id for snap in snapshots.values() for i in snap.running}
    reqs = []
    for rid, req in sorted(requests.items()):
        info = progress.get(rid)
        done = info.num_output_tokens if info else 0
        if done >= req.sampling.max_new_tokens:
            continue
        reqs.append(ReqProgress(request_id=rid, prompt_key=prompt_keys[rid],
                                num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=done,
                                max_new_tokens=req.sampling.max_new_tokens,
                                replica=assignment.get(rid) if assignment else None,
                                cached=None if running is None else rid in running))
    loads: tuple[ReplicaLoad, ...] = ()
    if snapshots:
        polled = {r: replica_load(snap) for r, snap in snapshots.items()}
        capacity = next(iter(polled.values())).kv_tokens_capacity  # the replicas of one layout hold alike
        idle = ReplicaLoad(num_waiting=0, num_running=0, kv_tokens_used=0, kv_tokens_capacity=capacity)
        loads = tuple(polled.get(r, idle) for r in range(num_devices // tp))
    return ClusterState(step=step, num_devices=num_devices, tp=tp, requests=tuple(reqs), loads=loads,
                        reported_spec=reported_spec, entry_s=entry_s)


def start_state(step: int, num_devices: int, tp: int, requests: list[Request],
                prompt_keys: Mapping[str, str], entry_s: tuple[tuple[int, float], ...] = ()) -> ClusterState:
    """The planner's view of a batch about to be dispatched (nothing generated, replicas not chosen yet) at the
    driver's step count `step` (the clock its hysteresis guards count in)."""
    return ClusterState(step=step, num_devices=num_devices, tp=tp, requests=tuple(
        ReqProgress(request_id=r.request_id, prompt_key=prompt_keys.get(r.request_id),
                    num_prompt_tokens=len(r.prompt_token_ids), num_output_tokens=0,
                    max_new_tokens=r.sampling.max_new_tokens) for r in requests), entry_s=entry_s)


def poll_sample(tp: int, results: Mapping[int, tuple[StepResult, EngineSnapshot]], elapsed_s: float) -> PollSample | None:
    """What one poll measured, for calibration: per busy replica its mean batch over the poll and its mean context;
    None when the poll also prefilled (a different cost: a request that has generated no more tokens than the poll
    ran steps started in it), finished a request (its bookkeeping and output are not a decode step's cost: such
    polls read up to 15% slow on the CPU pool, and a draining stage's mid-size batches were seen only in them) or
    no replica ran a full poll."""
    num_steps = max((step.num_steps for step, _ in results.values()), default=0)
    if elapsed_s <= 0 or any(step.num_prefill_tokens or step.finished or any(
            i.num_output_tokens <= num_steps for i in snap.running) for step, snap in results.values()):
        return None
    replicas = []
    for step, snap in results.values():
        if step.num_steps != num_steps or not snap.running:
            continue  # drained during the poll: the others set the poll's time
        context = sum(i.num_prompt_tokens + i.num_output_tokens for i in snap.running) / len(snap.running)
        replicas.append((step.num_decode_tokens / num_steps, max(0.0, context - num_steps / 2.0)))
    if num_steps < 1 or not replicas:
        return None
    return PollSample(tp=tp, replicas=tuple(replicas), num_steps=num_steps, elapsed_s=elapsed_s)
