"""Per-stage metrics of a generation stage, in verl's flat `prefix/name` style."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pat_rollout.driver.pool import ReconfigResult
    from pat_rollout.engine.base import StepResult


@dataclass(slots=True)
class StageMetrics:
    start_s: float = field(default_factory=time.perf_counter)
    end_s: float | None = None
    num_reconfigs: int = 0
    num_failed_reconfigs: int = 0
    num_migrated: int = 0
    num_recomputed: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0  # as the engines report it: prompts plus any recomputation
    num_import_fallbacks: int = 0  # migrations an engine recomputed anyway (no free KV blocks)
    kv_bytes_received: int = 0
    num_polls: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    layouts: list[tuple[float, str, int]] = field(default_factory=list)  # (seconds, layout, polls) when it began
    kv_tokens: list[tuple[str, int]] = field(default_factory=list)  # (layout, KV tokens one replica holds) if known
    response_lengths: list[int] = field(default_factory=list)
    last_switch_s: float | None = None
    planner: dict[str, float] = field(default_factory=dict)  # the planner's own stage metrics (calibration, start)
    num_rebalances: int = 0
    num_failed_rebalances: int = 0
    num_rebalanced: int = 0  # requests moved between replicas of one layout
    rebalance_phase_s: dict[str, float] = field(default_factory=dict)
    replica_finish_s: dict[int, float] = field(default_factory=dict)  # replica -> its latest completion

    def record_step(self, replica: int, step: StepResult) -> None:
        """What one poll's steps of `replica` generated."""
        self.num_decode_tokens += step.num_decode_tokens
        self.num_prefill_tokens += step.num_prefill_tokens
        if step.finished:
            self.record_replica_finish(replica)

    def record_reconfig(self, result: ReconfigResult, layout: str, kv_tokens: int | None = None) -> None:
        """A switch to `layout` succeeded; `kv_tokens`: KV tokens one of its replicas holds (None: not known)."""
        self.num_reconfigs += 1
        self.num_migrated += len(result.migrated)
        self.num_recomputed += len(result.recomputed)
        self.num_import_fallbacks += len(result.import_fallbacks)
        self.kv_bytes_received += result.kv_bytes_received
        for phase, s in result.phase_s.items():
            self.add_phase(phase, s)
        self.last_switch_s = time.perf_counter()
        self.record_layout(layout, kv_tokens)

    def record_rebalance(self, phase_s: dict[str, float], num_moved: int, num_migrated: int,
                         num_recomputed: int) -> None:
        """A rebalance moved `num_moved` requests; its hand-offs count in num_migrated / num_recomputed too."""
        self.num_rebalances += 1
        self.num_rebalanced += num_moved
        self.num_migrated += num_migrated
        self.num_recomputed += num_recomputed
        for phase, sec in phase_s.items():
            self.rebalance_phase_s[phase] = self.rebalance_phase_s.get(phase, 0.0) + sec

    def record_replica_finish(self, replica: int) -> None:
        """A request of `replica` (of the current layout) finished now."""
        self.replica_finish_s[replica] = time.perf_counter()

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    def record_layout(self, layout: str, kv_tokens: int | None = None) -> None:
        """The stage runs in `layout` from now; `kv_tokens`: KV tokens one of its replicas holds, if the pool
        reports it (`Pool.kv_tokens`)."""
        if self.layouts and self.layouts[-1][1] != layout:
            self.replica_finish_s.clear()  # the finish spread is over the replicas of the last layout
        self.layouts.append((time.perf_counter() - self.start_s, layout, self.num_polls))
        if kv_tokens is not None:
            self.kv_tokens.append((layout, kv_tokens))

    def finish(self) -> None:
        self.end_s = time.perf_counter()

    def as_dict(self, prefix: str = "pat") -> dict[str, float | str]:
        end = self.end_s if self.end_s is not None else time.perf_counter()
        lengths = self.response_lengths or [0]
        out: dict[str, float | str] = {
            f"{prefix}/gen_time_s": end - self.start_s,
            f"{prefix}/num_reconfigs": self.num_reconfigs,
            f"{prefix}/num_failed_reconfigs": self.num_failed_reconfigs,
            f"{prefix}/num_migrated": self.num_migrated,
            f"{prefix}/num_recomputed": self.num_recomputed,
            f"{prefix}/decode_tokens": self.num_decode_tokens,
            f"{prefix}/prefill_tokens": self.num_prefill_tokens,
            f"{prefix}/num_import_fallbacks": self.num_import_fallbacks,
            f"{prefix}/kv_bytes_received": self.kv_bytes_received,
            f"{prefix}/response_length_min": min(lengths),
            f"{prefix}/response_length_mean": sum(lengths) / len(lengths),
            f"{prefix}/response_length_max": max(lengths),
            f"{prefix}/tail_time_after_switch_s": (end - self.last_switch_s) if self.last_switch_s else 0.0,
            f"{prefix}/num_rebalances": self.num_rebalances,
            f"{prefix}/num_failed_rebalances": self.num_failed_rebalances,
            f"{prefix}/num_rebalanced": self.num_rebalanced,
            f"{prefix}/replica_finish_spread_s": (max(self.replica_finish_s.values()) - min(self.replica_finish_s.values())
                                                  if self.replica_finish_s else 0.0),
            f"{prefix}/layouts": " -> ".join(f"{layout}@{t:.2f}s" for t, layout, _ in self.layouts),
            # the same by the stage's poll count: the decisions a simulator replays (sim.policies.ReplayPolicy)
            f"{prefix}/layout_polls": " -> ".join(f"{layout}@{polls}" for _, layout, polls in self.layouts),
        }
        if self.kv_tokens:  # KV capacity per replica: in the layout the stage ended in, and at each layout
            out[f"{prefix}/kv_tokens_per_replica"] = self.kv_tokens[-1][1]
            out[f"{prefix}/kv_tokens_layouts"] = " -> ".join(f"{layout}:{n}" for layout, n in self.kv_tokens)
        for phase, s in sorted(self.phase_s.items()):
            out[f"{prefix}/reconfig_{phase}_s"] = s
        for phase, s in sorted(self.rebalance_phase_s.items()):
            out[f"{prefix}/rebalance_{phase}_s"] = s
        out.update(self.planner)
        return out
