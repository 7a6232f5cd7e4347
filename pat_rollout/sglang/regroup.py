"""Driver side of PAT reconfiguration on SGLang's own state (issue 6, milestone 3; see README.md).

Two mechanisms, both running pat_rollout's plan (`plan_layout` rank order, `plan_weights`, `reshard_local`:
a grow-by-merge moves zero bytes) on SGLang's live parameters inside the scheduler processes:

* `regroup_grow` (same processes): a `launch_pat_engine(..., tp_size=2, build_tp1=...)` engine whose ranks
  hold TP=1 replicas (built under a cached singleton group) is switched in place to TP=2: weights narrowed
  in place, module tree rebuilt around the same Parameters, KV heads sliced (`build_tp1="serve"`), and
  SGLang's own TP=2 group takes over. Both ranks see the same batches before the switch (one request path).
* `reshard_replicas_in_place` + `load_shards_direct` (separate engines): two real TP=1 engines reshard in
  place; the shards go into a third engine built for TP=2 via `update_weights_from_tensor(load_format="direct")`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from pat_rollout.sglang.launch import engine_env, patched_environ, server_kwargs

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine as SglEngine

_ENGINE_CLS: type | None = None


def pat_engine_class() -> type:
    """`sglang.Engine` whose scheduler processes carry pat_rollout's RPC methods (scheduler_hooks)."""
    global _ENGINE_CLS
    if _ENGINE_CLS is None:
        from sglang.srt.entrypoints.engine import Engine as SglEngine

        from pat_rollout.sglang import scheduler_hooks

        class PatSglEngine(SglEngine):
            run_scheduler_process_func = staticmethod(scheduler_hooks.run_scheduler_process)

        _ENGINE_CLS = PatSglEngine
    return _ENGINE_CLS


def launch_pat_engine(model_path: str, *, tp_size: int = 1, device: str = "cpu", build_tp1: bool | str = False,
                      **overrides: Any) -> SglEngine:
    """`build_tp1`: every rank builds and loads the model as a TP=1 replica (full weights) for a later
    in-process `regroup_grow`; the engine must not generate before that switch."""
    from pat_rollout.sglang.scheduler_hooks import BUILD_TP1_ENV

    env = engine_env(tp_size, device)
    env[BUILD_TP1_ENV] = build_tp1 if isinstance(build_tp1, str) else ("1" if build_tp1 else "0")
    with patched_environ(env, unset=("SGLANG_CPU_OMP_THREADS_BIND",)):
        cls = pat_engine_class()
        return cls(**server_kwargs(model_path, tp_size=tp_size, device=device, **overrides))


def save_params(engine: SglEngine, path: str, tp_size: int) -> list[dict]:
    """Every rank's SGLang parameters (local shards), index = tp_rank."""
    engine.collective_rpc("pat_save_params", path=path)
    return [torch.load(f"{path}.rank{r}.pt", weights_only=False) for r in range(tp_size)]


def reshard_replicas_in_place(engines: list[SglEngine], dst_tp: int, workdir: str) -> list[dict]:
    """Device d = the only rank of TP=1 engine d. Each reshards its own params in place for the
    `len(engines) x TP=1 -> TP=dst_tp` plan. Returns per device: new shards, new_rank, identity facts."""
    src_groups = [[d] for d in range(len(engines))]
    out = []
    for d, eng in enumerate(engines):  # grow-by-merge: no device sends or receives, so one at a time is fine
        path = os.path.join(workdir, "reshard")
        eng.collective_rpc("pat_reshard_in_place", src_groups=src_groups, device=d, dst_tp=dst_tp, path=path)
        out.append(torch.load(f"{path}.dev{d}.pt", weights_only=False))
    return out


def load_shards_direct(engine: SglEngine, shards_by_rank: list[dict[str, torch.Tensor]]) -> None:
    """Load per-rank shards (SGLang param names, exact local shapes) with SGLang's own
    `update_weights_from_tensor(load_format="direct")` path; rank r deserializes only its own tensor.

    Builds the request itself rather than calling `Engine.update_weights_from_tensor`, which sizes the
    per-rank payload list from the driver process's `get_parallel().tp_size` (last engine published wins
    when several engines live in one process)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils.common import MultiprocessingSerializer

    tp = len(shards_by_rank)
    names = sorted(shards_by_rank[0])
    named = [(n, LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(shards_by_rank[r][n].contiguous())
                                               for r in range(tp)])) for n in names]
    payload = [MultiprocessingSerializer.serialize(named) for _ in range(tp)]
    obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format="direct", flush_cache=True)
    engine.begin_weight_update()
    try:
        ok, msg = engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(obj, None))
    finally:
        engine.end_weight_update()
    if not ok:
        raise RuntimeError(f"update_weights_from_tensor(load_format='direct') failed: {msg}")


def regroup_grow(engine: SglEngine, tp_size: int, workdir: str) -> list[dict]:
    """In-process switch of a `build_tp1` engine: TP=1 replicas on its ranks -> one TP group (see
    scheduler_hooks.pat_regroup_grow). Returns per rank: Parameter identity facts, new rank, bytes moved."""
    path = os.path.join(workdir, "regroup")
    engine.collective_rpc("pat_regroup_grow", path=path)
    return [torch.load(f"{path}.rank{r}.pt", weights_only=False) for r in range(tp_size)]
