"""PAT rollout options as one frozen dataclass. The only place besides verl/ that sees user config;
`pat_rollout.verl` converts verl's OmegaConf into this once, at the boundary."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pat_rollout.planner import PlannerConfig

# A backend is a package whose `backend` module builds its pool (`driver.backends.Backend`); imported by name when
# the driver asks for it, so the reference path never imports sglang.
BACKEND_MODULES = {
    "reference": "pat_rollout.workers.backend",  # the plain-PyTorch engine on one Ray actor per device
    "sglang": "pat_rollout.sglang.backend",  # one SGLang engine whose scheduler ranks are the replicas
    "vllm": "pat_rollout.vllm.backend",  # one vLLM engine per replica of the current layout (pat_rollout/vllm)
}
BACKENDS = tuple(BACKEND_MODULES)
POLICIES = ("pat", "static", "manual")
KV_HANDOFFS = ("auto", "migrate", "recompute")
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
DTYPES = tuple(DTYPE_BYTES)


@dataclass(frozen=True, kw_only=True, slots=True)
class PatRolloutConfig:
    """Options of one PAT rollout pool: `num_devices` devices that PAT regroups into TP layouts.

    - initial_tp: the layout the stage starts in (num_devices / initial_tp replicas).
    - candidate_tps: TP sizes the planner may switch to; all process groups for them are built at start-up.
    - policy: "pat" (planner decides), "static" (never reconfigure: the baseline) or "manual"
      (only `RolloutDriver.reconfigure(tp)` switches: tests and experiments).
    - kv_handoff: per-request choice between KV migration and recomputation; "auto" uses the cost model.
    - steps_per_poll: decode steps each actor runs per driver RPC; the planner re-evaluates at every poll.
    - planner: options for pat_rollout.planner's PlannerConfig (validated there).
    - engine_args: extra SGLang ServerArgs for backend="sglang" (e.g. mem_fraction_static, enable_memory_saver)
      or vLLM EngineArgs for backend="vllm" (e.g. gpu_memory_utilization, max_model_len);
      from verl, gpu_memory_utilization and free_cache_engine fill these.
    - layout_custom_all_reduce: backend="sglang" on GPUs: give the groups of the layouts other than the base one a
      custom all-reduce (SGLang's default, about 0.7 GB of device memory per group); False saves it (their graphs
      then reduce through pynccl).
    - comm_timeout_s: torch.distributed timeout of every collective and transfer between devices, so a peer
      blocked on a failed device errors out instead of waiting forever.
    - rpc_timeout_s, rpc_timeout_per_token_s: every RPC the driver waits on has the deadline
      comm_timeout_s + rpc_timeout_s + tokens of work x rpc_timeout_per_token_s (the floor lets a blocked
      transfer fail on the device first); a device that misses it marks the pool broken.
    - transfer_timeout_floor_s, transfer_min_bytes_per_s: a KV hand-off or reshard transfer on the reference
      backend waits at most floor + bytes moved / min rate (capped at comm_timeout_s), so a peer that never
      arrives releases the others within seconds; a device that fails such a step releases them at once.
    - transfer_chunk_bytes: a switch moves weights and KV in rounds of at most this many bytes per device, which
      bounds its scratch memory (device and pinned host) to about one chunk (docs/gpu.md).
    - kv_handoff_max_bytes: the most KV bytes one device receives in a switch's hand-off (held in host memory from
      the exchange to the import); requests beyond it are recomputed. None: a quarter of the host memory available
      at start-up, shared by the devices (`kv_handoff_cap`).
    - reclaim_weight_memory: backend="sglang": a layout lends the weight memory its shard no longer uses to the KV
      cache (docs/kv_reclaim.md; the base layout must be the smallest TP). The storages are adopted into reserved
      virtual memory inside SGLang's start-up, before its KV pool and graph capture (CPU: vmem.host.HostMapper,
      tested; CUDA: vmem.cuda.CudaMapper, not run on a GPU yet); refused with engine_args' enable_memory_saver (its
      release would not reach the adopted storages); off by default.
    """

    model_path: str
    num_devices: int
    backend: str = "reference"
    initial_tp: int = 1
    candidate_tps: tuple[int, ...] = ()
    policy: str = "pat"
    kv_handoff: str = "auto"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 256
    steps_per_poll: int = 8
    profile_path: str | None = None
    planner: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)
    layout_custom_all_reduce: bool = True
    comm_timeout_s: float = 120.0
    rpc_timeout_s: float = 60.0
    rpc_timeout_per_token_s: float = 0.05
    transfer_timeout_floor_s: float = 5.0
    transfer_min_bytes_per_s: float = 100e6
    transfer_chunk_bytes: int = 64 << 20
    kv_handoff_max_bytes: int | None = None
    reclaim_weight_memory: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is unknown; expected one of {BACKENDS}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is unknown; expected one of {POLICIES}")
        if self.kv_handoff not in KV_HANDOFFS:
            raise ValueError(f"kv_handoff={self.kv_handoff!r} is unknown; expected one of {KV_HANDOFFS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; expected one of {DTYPES}")
        if self.num_devices < 1:
            raise ValueError(f"num_devices={self.num_devices} must be >= 1")
        for tp in (self.initial_tp, *self.candidate_tps):
            if tp < 1 or self.num_devices % tp:
                raise ValueError(f"TP size {tp} must divide num_devices={self.num_devices}")
        if self.candidate_tps and self.initial_tp not in self.candidate_tps:
            raise ValueError(f"initial_tp={self.initial_tp} must be one of candidate_tps={self.candidate_tps}")
        if self.engine_args and self.backend not in ("sglang", "vllm"):
            raise ValueError(f"engine_args={self.engine_args} apply to backend='sglang' or 'vllm' only (SGLang "
                             f"ServerArgs, vLLM EngineArgs); "
                             f"backend={self.backend!r} takes its options as fields of this config")
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "steps_per_poll", "transfer_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("comm_timeout_s", "rpc_timeout_s", "rpc_timeout_per_token_s", "transfer_timeout_floor_s",
                     "transfer_min_bytes_per_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite number > 0")

        if self.reclaim_weight_memory and (self.backend != "sglang" or self.initial_tp != min(self.tp_sizes)):
            raise ValueError(f"reclaim_weight_memory needs backend='sglang' (got {self.backend!r}) and initial_tp "
                             f"the smallest TP size (initial_tp={self.initial_tp}, TP sizes {self.tp_sizes})")
        if self.kv_handoff_max_bytes is not None and (isinstance(self.kv_handoff_max_bytes, bool)
                                                      or not isinstance(self.kv_handoff_max_bytes, int)
                                                      or self.kv_handoff_max_bytes < 0):
            raise ValueError(f"kv_handoff_max_bytes={self.kv_handoff_max_bytes!r} must be None or an int >= 0")

    def kv_handoff_cap(self) -> int:
        """Bytes of migrated KV one device may receive in a switch: `kv_handoff_max_bytes`, or by default a quarter
        of the host memory available now divided among `num_devices` (the received KV waits in host memory)."""
        if self.kv_handoff_max_bytes is not None:
            return self.kv_handoff_max_bytes
        try:
            import psutil

            available = int(psutil.virtual_memory().available)
        except ImportError:
            import os

            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # free pages: a lower bound
        return available // 4 // self.num_devices

    def planner_config(self) -> PlannerConfig:
        """`planner` as a validated pat_rollout.planner.PlannerConfig over this pool's TP sizes. The driver
        calls it under every policy, so an unknown option fails under 'static' as loudly as under 'pat'."""
        from pat_rollout.planner import PlannerConfig  # pure; imported late so config stays dependency-free

        allowed = {f.name for f in dataclasses.fields(PlannerConfig)} - {"candidate_tps"}
        if unknown := sorted(set(self.planner) - allowed):
            raise ValueError(f"unknown planner option(s) {unknown} (policy={self.policy!r}); "
                             f"allowed: {sorted(allowed)}")
        return PlannerConfig(candidate_tps=self.tp_sizes, **self.planner)

    def rpc_deadline_s(self, work_tokens: int = 0) -> float:
        """Seconds the driver waits for one RPC that processes `work_tokens` tokens (see the class doc)."""
        return self.comm_timeout_s + self.rpc_timeout_s + work_tokens * self.rpc_timeout_per_token_s

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """Every TP size this pool may use, ascending (initial_tp alone for the static policy)."""
        if self.policy == "static":
            return (self.initial_tp,)
        if self.candidate_tps:
            return tuple(sorted(set(self.candidate_tps)))
        return tuple(tp for tp in (1, 2, 4, 8, 16) if self.num_devices % tp == 0)

    @property
    def max_tp(self) -> int:
        return max(self.tp_sizes)
