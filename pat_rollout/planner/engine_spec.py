"""`EngineSpec`: what the engine is configured with (scheduler rules, KV tokens per replica of each TP size), as the
planner's lookahead and the simulator read it. Pure stdlib."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pat_rollout.planner.capacity import MemorySpec, replica_kv_tokens
from pat_rollout.planner.engine_model import SchedulerModel
from pat_rollout.profile.model import LatencyModel

UNBOUNDED_KV_TOKENS = 1 << 50


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """What the engine is configured with, as the driver reads it from its engine (and the simulator from its
    truth): the scheduler's rules and the KV tokens one replica of each TP size holds."""

    scheduler: SchedulerModel
    kv_tokens: Mapping[int, int]

    def capacity(self, tp: int) -> int:
        if tp not in self.kv_tokens:
            raise ValueError(f"no KV capacity for tp={tp}; known {sorted(self.kv_tokens)}")
        return self.kv_tokens[tp]

    @classmethod
    def sglang_gpu(cls, model: LatencyModel, tps: Sequence[int], mem: MemorySpec | None = None) -> EngineSpec:
        """SGLang on GPUs: its scheduler defaults, capacity from `mem` (default the profile's memory section)
        through the capacity rule."""
        if mem is None:
            if model.memory is None:
                raise ValueError(f"profile {model.meta.get('model')!r} has no memory section: KV capacity unknown")
            mem = MemorySpec.from_dict(model.memory)
        shape = model.model
        kv = {tp: replica_kv_tokens(mem, param_bytes=shape.param_bytes, kv_bytes_per_token=shape.kv_bytes_per_token(),
                                    num_kv_heads=shape.num_kv_heads, tp=tp) for tp in tps}
        return cls(scheduler=SchedulerModel(kind="sglang", max_num_seqs=1024, max_prefill_tokens=16384, block_size=1),
                   kv_tokens=kv)

    @classmethod
    def default_for(cls, model: LatencyModel, tps: Sequence[int]) -> EngineSpec:
        """Without word from the engine: SGLang on GPUs when the profile has a memory section, else an engine
        whose KV never binds (the estimate then is the pure decode drain)."""
        if model.memory is not None:
            return cls.sglang_gpu(model, tps)
        return cls(scheduler=SchedulerModel(kind="ref", max_num_seqs=1 << 30, max_prefill_tokens=1 << 30),
                   kv_tokens={tp: UNBOUNDED_KV_TOKENS for tp in tps})
