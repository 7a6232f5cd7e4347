"""`SglPool`: the driver's pool on real SGLang engines (`engine_kwargs.pat.backend=sglang`).

One `sglang.Engine` with one scheduler process per device (SGLang TP = number of devices); its ranks serve as
the replicas of the current PAT layout (`pool_hooks`: cached groups per layout, per-replica request routing and
output). A layout switch (`pool_switch.pat_switch`) aborts every unfinished request through SGLang's API, keeps
its tokens and log-probs, moves the KV of the requests chosen for migration between the ranks' radix caches with
pat_rollout's KV plan, reshards SGLang's parameters in place, rebuilds its modules for the new groups, and
resubmits every request to its new replica (migrated ones hit the prefix cache, the rest re-prefill).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pat_rollout.config import DTYPE_BYTES, PatRolloutConfig
from pat_rollout.driver.errors import PoolBrokenError, ReconfigurationError, WorkerError
from pat_rollout.driver.pool import Pool, ReconfigResult
from pat_rollout.engine.base import EngineSnapshot, StepResult
from pat_rollout.kv.cost import HandoffCost
from pat_rollout.layout import Layout
from pat_rollout.sglang import layout_comm  # stdlib/torch only at import
from pat_rollout.types import ModelSpec, Request, RequestOutput, RequestState
from pat_rollout.workers.reconfigure import balance_states, handoff_method, limit_by_memory

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `make install-sglang` (see pat_rollout/sglang/INSTALL.md)"


def check_model(config: PatRolloutConfig) -> ModelSpec:
    """Fail before any process starts: SGLang importable, a HF config, TP sizes that divide the heads."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError(f"backend='sglang' needs SGLang, which is not installed in this environment; {INSTALL_HINT}")
    spec = ModelSpec.from_model_path(config.model_path, config.tp_sizes)
    check_page_size(config.engine_args)
    smallest = min(config.tp_sizes)
    if config.initial_tp > smallest:
        # SGLang splits its memory budget (mem_fraction_static) once, in the base layout: weights of that TP,
        # the rest KV. The KV storage follows the layout (kv_room), the weights cannot: a smaller TP holds
        # more of them per rank than the budget accounted for (OOM on a GPU).
        raise ValueError(
            f"backend='sglang': initial_tp={config.initial_tp} is above the smallest TP size {smallest} of "
            f"tp_sizes={config.tp_sizes}; SGLang sizes its memory for the base layout's weights (1/"
            f"{config.initial_tp} per rank), so TP{smallest} would need {config.initial_tp / smallest:g}x the "
            f"weight memory per rank. Start in the smallest TP (initial_tp={smallest}) or drop the smaller "
            f"sizes from candidate_tps")
    return spec


def check_page_size(engine_args: dict[str, Any]) -> None:
    """The KV hand-off moves single-token slots into SGLang's allocator, which rounds every allocation to whole
    pages (`_insert_prefix` would get fewer slots than tokens): refuse page_size > 1 before anything starts."""
    if (engine_args.get("page_size") or 1) > 1:
        raise ValueError(f"SglPool: engine_args['page_size']={engine_args['page_size']} is not supported: the KV "
                         "hand-off moves single-token slots and SGLang's paged allocator rounds to whole pages; "
                         "use page_size=1 (SGLang's default; trtllm_mha and FA3 with --page-size set larger ones)")


def check_reclaim(config: PatRolloutConfig, engine_args: dict[str, Any]) -> None:
    """reclaim_weight_memory with SGLang's memory saver (`enable_memory_saver`, verl's release / resume of weights
    and KV between RL steps) is refused, on every device: the adopted storages live in the reclaiming mapper's
    ranges, outside torch_memory_saver's regions, so a release would free none of them (docs/kv_reclaim.md). So is
    0.5.23's `startup_weight_load_mode="overlap"`: `load_model` returns placeholder weights there and commits the
    real ones after the graph capture, after the adoption."""
    if not config.reclaim_weight_memory:
        return
    if engine_args.get("startup_weight_load_mode") == "overlap":
        raise ValueError("SglPool: reclaim_weight_memory=True with startup_weight_load_mode='overlap' is not "
                         "supported: the weights are adopted right after load_model, which returns placeholders in "
                         "that mode (docs/kv_reclaim.md)")
    if engine_args.get("enable_memory_saver"):
        raise ValueError("SglPool: reclaim_weight_memory=True with engine_args['enable_memory_saver']=True is not "
                         "supported: the weights and KV are adopted into the reclaiming mapper's ranges, which "
                         "SGLang's memory saver does not manage, so release_memory_occupation would free none of "
                         "them; turn one of the two off (docs/kv_reclaim.md)")


def pool_layouts(config: PatRolloutConfig) -> dict[int, Layout]:
    """The one layout per TP size an SglPool uses: contiguous groups in ascending rank order
    (`Layout.uniform`). SGLang builds a group from a rank list whose collectives run in sorted-rank order, so
    the interleaved in-place order `plan_layout` picks for deeper grows (8 devices TP2 -> TP4 gives
    `(0, 2, 1, 3)`) cannot be expressed; with contiguous groups a grow from TP1 is still in place (zero bytes)
    and a grow between larger TPs moves the bytes `plan_weights` computes."""
    return {tp: Layout.uniform(config.num_devices, tp) for tp in sorted(set(config.tp_sizes) | {config.initial_tp})}


def launch_pool_engine(config: PatRolloutConfig, layouts: dict[int, Layout], device: str, stack_dir: str = "",
                       **overrides: Any):
    from pat_rollout.sglang.launch import engine_env, pat_engine_class, patched_environ, server_kwargs
    from pat_rollout.sglang.pool_hooks import POOL_ENV

    env = engine_env(config.num_devices, device)
    env["SGLANG_ENABLE_RANK_CONSENSUS_CHECKER"] = "0"  # ranks of different replicas diverge by design
    env.update(layout_comm.engine_env(config.layout_custom_all_reduce))  # --- (#35)
    if config.reclaim_weight_memory:  # (#37) docs/kv_reclaim.md
        from pat_rollout.sglang.kv_room import RECLAIM_ENV

        env[RECLAIM_ENV] = "1"
        # 0.5.23's post-capture KV sizing backs the KV pool after the graph capture (its own VMM): the adoption
        # needs the KV pool allocated before the capture (kv_room refuses a post-capture pool as well)
        env["SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"] = "0"
    base = Layout.uniform(config.num_devices, config.initial_tp)
    env[POOL_ENV] = json.dumps({"base": [list(g) for g in base.groups],
                                "layouts": {str(tp): [list(g) for g in lay.groups] for tp, lay in layouts.items()},
                                "stack_dir": stack_dir})
    with patched_environ(env, unset=("SGLANG_CPU_OMP_THREADS_BIND",)):
        engine_cls = pat_engine_class()  # checks the inventory first: SGLang imports under the engine's env
        return engine_cls(**server_kwargs(config.model_path, tp_size=config.num_devices, device=device,
                                          **pool_engine_args(config, **overrides)))


def pool_engine_args(config: PatRolloutConfig, **overrides: Any) -> dict[str, Any]:
    """The ServerArgs an SglPool sets on top of `launch.server_kwargs` (`overrides`, e.g. engine_args, win).
    Overlap scheduling stays on (SGLang's default): a switch RPC first processes the batch still in flight
    (`pool_switch._drain`, as SGLang's own pause does). Decode CUDA graphs are off
    unless `engine_args={"disable_cuda_graph": False}` (a GPU; every candidate layout captures its own at start-up,
    `layout_graphs`, `pool_startup`; untested on a GPU); prefill (piecewise) graphs are always off: their runner keeps the base
    layout's attention layers. `max_running_requests` per rank, i.e. per replica, as verl's SGLang server
    passes its `max_num_seqs`. A SIGQUIT from a failed scheduler must not kill the driver's process
    (`rank_rpc.child_failed`). Imports sglang: call with the engine's environment set."""
    from pat_rollout.sglang import compat
    from pat_rollout.sglang.rank_rpc import child_failed

    kw: dict[str, Any] = dict(dtype=config.dtype, random_seed=config.seed, disable_cuda_graph=True,
                              max_running_requests=config.max_num_seqs, custom_sigquit_handler=child_failed,
                              **compat.prefill_graph_off_args())
    kw.update(overrides)
    check_page_size(kw)
    if kw.get("sleep_on_idle"):
        raise ValueError("SglPool: sleep_on_idle is not supported: a replica leader other than rank 0 reads its "
                         "requests from its own socket (replica_input), which SGLang's idle sleeper does not watch, so "
                         "it would see them only when its 1 s sleep ends")
    return kw


class SglPool(Pool):
    """`config.num_devices` SGLang ranks grouped into the current layout. Not thread-safe (driver thread only)."""

    def __init__(self, config: PatRolloutConfig, spec: ModelSpec, base: Layout, *, cost: HandoffCost | None = None,
                 device: str | None = None, **server_overrides: Any) -> None:
        import torch

        from pat_rollout.sglang.engine import SGLangEngine

        self.config, self.spec, self.cost = config, spec, cost
        self.num_devices = config.num_devices
        self.base = self.layout = base
        self.layouts = pool_layouts(config)
        self.kv_cap = config.kv_handoff_cap()  # most KV bytes one rank receives in a switch (host memory)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        args = {**config.engine_args, **server_overrides}
        check_reclaim(config, args)
        if self.device == "cpu" and args.pop("enable_memory_saver", False):
            logger.info("SglPool on CPU: enable_memory_saver dropped (SGLang's memory saver needs CUDA)")
        self.memory_saver = bool(args.get("enable_memory_saver"))
        self.workdir = tempfile.mkdtemp(prefix="pat-sglpool-")  # RPC status files, per-rank stack dumps
        t0 = time.perf_counter()
        try:
            sgl = launch_pool_engine(config, self.layouts, self.device, stack_dir=self.workdir, **args)
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.client = SGLangEngine(config.model_path, tp_size=config.num_devices, sgl=sgl,
                                   eos_token_ids=spec.eos_token_ids)
        self.startup_s = time.perf_counter() - t0
        self._replica: dict[str, int] = {}  # request id -> replica in the current layout
        self._calls = 0  # RPCs so far: each gets its own status files
        self._prefill_tokens = 0  # tokens submitted since the last step (its deadline covers their prefill)
        self.pids: dict[int, int] = {}  # WORLD rank -> scheduler process id (dead-scheduler check)
        self._check_inventory()
        info = self.info()
        self.pids = {i["rank"]: i["pid"] for i in info}
        # KV tokens one replica of the current layout holds: SGLang's pool size on each of its ranks (kv_room)
        self.kv_tokens = min(i["kv_tokens"] for i in info)
        self.client.watch = self._check_alive
        page_size = int(getattr(sgl.server_args, "page_size", 1) or 1)  # as SGLang resolved it (backends pick)
        if page_size > 1:
            self.shutdown()
            raise ValueError(f"SglPool: the KV pool's page_size is {page_size} (engine_args['page_size'] or the "
                             f"attention backend's choice); the KV hand-off moves single-token slots, so it needs "
                             f"page_size=1: set engine_args['page_size']=1 or an attention backend with pages of 1")
        # (#37) reclaim_weight_memory: what SGLang's start-up adopted (kv_room.install_startup_hooks; docs/kv_reclaim.md)
        self.reclaim_start = self._rpc("pat_reclaim_start", path="") if config.reclaim_weight_memory else None
        self._rpc("pat_backup_base")
        self._backup_stale = False  # weights updated since the last host backup (end_weight_update takes one)
        from pat_rollout.sglang import pool_startup  # --- start-up communicators and captures (#35)

        self.startup = pool_startup.prepare(self)  # --- (#35)
        logger.info("SglPool up in %.1f s: %d SGLang ranks on %s, layout %s", self.startup_s, self.num_devices,
                    self.device, base)

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_inventory(self) -> None:
        """The SGLang attributes the pool reads on live schedulers (inventory.SCHEDULER), on every rank."""
        from pat_rollout.sglang import inventory

        moved = sorted({line for r in self._rpc("pat_check_inventory", path="") for line in r["missing"]})
        if moved:
            self.shutdown()
            raise RuntimeError(inventory.error_message(moved, "checked on the live scheduler processes"))

    def _rpc(self, method: str, work_tokens: int = 0, **kw: Any) -> list[dict] | None:
        """`method` on every rank, bounded by `config.rpc_deadline_s(work_tokens)` and by every scheduler being
        alive (`rank_rpc.call`: a hung or dead rank is a WorkerError with unresponsive=True naming it). A rank
        that raised is a WorkerError naming each failed rank and the phase it failed in. Methods taking `path`
        write one JSON per rank, returned in rank order."""
        from pat_rollout.sglang import rank_rpc

        asyncio.set_event_loop(self.client.loop)
        self._calls += 1
        status = os.path.join(self.workdir, f"{method}.{self._calls}")
        if "path" in kw:
            kw["path"] = status
        ok, message = rank_rpc.call(self.client.sgl, method, kw, status=status, num_ranks=self.num_devices,
                                    deadline_s=self.config.rpc_deadline_s(work_tokens), check_alive=self._check_alive,
                                    on_deadline=self._dump_stacks)
        statuses = rank_rpc.read_statuses(status, self.num_devices)
        failed = [r for r in range(self.num_devices) if not statuses.get(r, {"ok": False})["ok"]]
        if failed:
            raise WorkerError(f"SglPool RPC {method} failed: {rank_rpc.describe_failures(status, self.num_devices)}",
                              failed)
        if not ok:  # every rank wrote ok but SGLang says otherwise (e.g. an unknown method)
            raise WorkerError(f"SglPool RPC {method} failed: rank 0 reported {message!r}", [0])
        if "path" not in kw:
            return None
        return [json.loads(Path(f"{status}.rank{r}.json").read_text()) for r in range(self.num_devices)]

    def _check_alive(self, what: str) -> None:
        """WorkerError(unresponsive) naming every scheduler rank whose process is gone (killed, crashed)."""
        from pat_rollout.sglang.rank_rpc import is_gone

        if dead := [rank for rank, pid in sorted(self.pids.items()) if is_gone(pid)]:
            layout_comm.request_abort(self.workdir, f"{what}: rank(s) {dead} died")  # --- NCCL abort (#35)
            raise WorkerError(f"SglPool {what}: the scheduler process of rank(s) {dead} died "
                              f"(pids {[self.pids[r] for r in dead]})", dead, unresponsive=True)

    def _dump_stacks(self) -> None:
        """Log every live scheduler's stacks (all threads; `pool_hooks.STACK_DUMP_SIGNAL`, each rank writes its own
        file): where each rank waits is what tells a hang's cause (e.g. one rank in a forward's all-reduce, another
        in the request broadcast: their admission diverged)."""
        from pat_rollout.sglang.pool_hooks import STACK_DUMP_SIGNAL, stack_dump_path

        layout_comm.request_abort(self.workdir, "an RPC missed its deadline")  # --- NCCL abort (#35)
        for pid in self.pids.values():
            try:
                os.kill(pid, STACK_DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        time.sleep(1.0)  # faulthandler writes from the signal handler: give them a moment
        for rank, pid in sorted(self.pids.items()):
            path = Path(stack_dump_path(self.workdir, pid))
            text = path.read_text() if path.exists() else "(no dump)"
            logger.error("SglPool scheduler rank %d (pid %d) stacks:\n%s", rank, pid, text)

    def _engine_timeout(self, e: Exception, what: str, ranks: Iterable[int]) -> WorkerError:
        ranks = sorted(ranks) or list(range(self.num_devices))
        layout_comm.request_abort(self.workdir, f"{what} missed its deadline on rank(s) {ranks}")  # --- (#35)
        return WorkerError(f"SglPool {what}: {e} (PatRolloutConfig.rpc_deadline_s); scheduler rank(s) {ranks} "
                           f"made no progress", ranks, unresponsive=True)

    def check_request(self, request: Request) -> None:
        prompt, spec = request.prompt_token_ids, self.spec
        if bad := [t for t in prompt if not 0 <= t < spec.vocab_size]:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:8]} outside vocab [0, {spec.vocab_size})")
        total = len(prompt) + request.sampling.max_new_tokens
        if total > spec.max_position_embeddings:
            raise ValueError(f"request {request.request_id!r}: prompt {len(prompt)} + max_new_tokens "
                             f"{request.sampling.max_new_tokens} = {total} > max_position_embeddings="
                             f"{spec.max_position_embeddings}")
        if total > self.client.max_total_num_tokens:
            raise ValueError(f"request {request.request_id!r} can never fit: {total} tokens > the KV pool's "
                             f"{self.client.max_total_num_tokens} tokens in the base layout")

    # ---- serving ---------------------------------------------------------------------------------
    def add_requests(self, per_replica: dict[int, list[Request]]) -> None:
        asyncio.set_event_loop(self.client.loop)
        for r, reqs in per_replica.items():
            self.client.add_requests(reqs, replica=r)
            self._prefill_tokens += sum(len(q.prompt_token_ids) for q in reqs)
            self._replica.update({q.request_id: r for q in reqs})

    def step(self, replicas: Iterable[int], num_steps: int) -> dict[int, tuple[StepResult, EngineSnapshot]]:
        asyncio.set_event_loop(self.client.loop)
        replicas = list(replicas)
        before = self.client.output_lengths()
        work = self._prefill_tokens + num_steps * len(before)
        try:
            res = self.client.step(num_steps, timeout=self.config.rpc_deadline_s(work))
        except TimeoutError as e:  # engine.EngineTimeout
            now = self.client.output_lengths()
            stuck = {self._replica.get(rid, 0) for rid, n in before.items() if now.get(rid, n) == n}
            raise self._engine_timeout(e, "decode step", [d for r in stuck for d in self.layout.groups[r]]) from e
        self._prefill_tokens = 0
        after = self.client.output_lengths()
        snap = self.client.snapshot()
        out: dict[int, tuple[StepResult, EngineSnapshot]] = {}
        for r in replicas:
            finished = tuple(o for o in res.finished if self._replica.get(o.request_id, replicas[0]) == r)
            mine = {rid for rid, rep in self._replica.items() if rep == r}
            decoded = sum(after.get(rid, 0) - before.get(rid, 0) for rid in mine if rid in after)
            decoded += sum(len(o.token_ids) - before.get(o.request_id, len(o.token_ids)) for o in finished)
            running = tuple(i for i in snap.running if i.request_id in mine)
            out[r] = (StepResult(finished=finished, num_steps=num_steps, num_decode_tokens=decoded,
                                 num_prefill_tokens=0, num_running=len(running), num_waiting=0,
                                 elapsed_s=res.elapsed_s),
                      EngineSnapshot(running=running, num_waiting=0, num_total_blocks=self.kv_tokens, block_size=1,
                                     num_free_blocks=max(0, self.kv_tokens - sum(
                                         i.num_prompt_tokens + i.num_output_tokens for i in running))))
        for o in res.finished:
            self._replica.pop(o.request_id, None)
        return out

    def abort_all(self) -> list[RequestOutput]:
        asyncio.set_event_loop(self.client.loop)
        try:
            outs = self.client.abort_all(timeout=self.config.rpc_deadline_s())
        except TimeoutError as e:  # engine.EngineTimeout
            raise self._engine_timeout(e, "abort", []) from e
        self._replica.clear()
        return outs

    # ---- reconfiguration -------------------------------------------------------------------------
    supports_rebalance = False  # the planner does not offer rebalancing on this pool

    def rebalance(self, moves: dict[str, int], assignment: dict[str, int]) -> Any:
        raise NotImplementedError(
            "SglPool cannot rebalance yet: moving a request between SGLang ranks of the same layout needs a "
            "per-request export/import between their radix caches (pool_switch only moves KV inside a layout "
            "switch); use the reference engine or a regroup")

    def entry_cost_s(self, tp: int) -> float:
        """The decode-graph capture a switch into `tp` would still run (pool_startup: 0 once captured, and every
        layout is captured at start-up)."""
        return self.startup.pending_capture_s(tp)

    def reconfigure(self, dst_tp: int, assignment: dict[str, int]) -> ReconfigResult:
        asyncio.set_event_loop(self.client.loop)
        t_start = time.perf_counter()
        src = self.layout
        self.spec.check_tp(dst_tp)
        if dst_tp not in self.layouts:
            raise ValueError(f"TP{dst_tp} is not one of this pool's TP sizes {sorted(self.layouts)}")
        dst = self.layouts[dst_tp]
        result = ReconfigResult(src=src, dst=dst)
        self.end_weight_update()  # weights synced since the last backup: back them up before anything can fail
        t = time.perf_counter()
        try:  # abort; tokens + log-probs come back with the aborts
            states = self.client.export_requests(None, timeout=self.config.rpc_deadline_s())
        except TimeoutError as e:  # engine.EngineTimeout
            raise PoolBrokenError(f"SGLang switch {src} -> TP{dst_tp}, phase export: "
                                  f"{self._engine_timeout(e, 'export (abort)', [])}") from e
        result.phase_s["export"] = time.perf_counter() - t
        new_assign = balance_states(states, dst.num_replicas)
        migrated = [s for s in states if self._method(s, dst) == "migrate"]
        # SGLang freed nothing it had cached: every token but the last sampled one has KV (an upper bound)
        migrated, _ = limit_by_memory(migrated, lambda s: s.num_tokens - 1,
                                      {s.request_id: dst.groups[new_assign[s.request_id]] for s in migrated},
                                      lambda tp: self.spec.kv_bytes_per_token(tp, DTYPE_BYTES[self.config.dtype]),
                                      self.kv_cap)
        moves = [[s.request_id, list(s.prompt_token_ids + s.output_token_ids), self._replica[s.request_id],
                  new_assign[s.request_id]] for s in migrated]
        c = self.config
        try:
            per_rank = self._rpc("pat_switch", work_tokens=sum(len(m[1]) for m in moves),
                                 dst_groups=[list(g) for g in dst.groups], moves=moves, path="",
                                 transfer_timeout=[c.transfer_timeout_floor_s, c.transfer_min_bytes_per_s,
                                                   c.comm_timeout_s], chunk_bytes=c.transfer_chunk_bytes)
        except Exception as e:
            what = f"SGLang switch {src} -> TP{dst_tp}"
            if isinstance(e, WorkerError) and e.unresponsive:  # its later calls would queue behind the hang
                raise PoolBrokenError(f"{what}: {e}; the pool cannot roll back and is broken") from e
            try:
                self._rollback(states)
            except Exception as e2:
                raise PoolBrokenError(f"{what} failed ({e}), and rolling back to the base layout {self.base} "
                                      f"failed ({e2}); the pool is broken") from e2
            err = ReconfigurationError(f"{what} failed ({e}); rolled back to base layout "
                                       f"{self.base}, {len(states)} unfinished requests resubmitted for recomputation")
            err.assignment = {rid: self._replica[rid] for rid in assignment if rid in self._replica}
            raise err from e
        self.layout = dst
        self.kv_tokens = min(r["kv_tokens"] for r in per_rank)
        for phase in ("kv_handoff", "reshard", "switch", "capture"):  # capture: a layout's first decode graphs
            result.phase_s[phase] = max(r["phase_s"][phase] for r in per_rank)
        t = time.perf_counter()
        self._submit(states, new_assign)
        result.phase_s["import"] = time.perf_counter() - t
        cached = per_rank[0]["cached_tokens"]
        # Requests that finished on their own before the abort landed come back from the next step (replica 0).
        for rid in assignment:
            if rid not in new_assign:
                self._replica[rid] = 0
        result.assignment = {rid: self._replica[rid] for rid in assignment}
        no_room = {rid for r in per_rank for rid in r.get("no_room", ())}  # reclaim_weight_memory: recomputed
        result.migrated = tuple(rid for rid in cached if cached[rid] > 0 and rid not in no_room)
        result.recomputed = tuple(s.request_id for s in states if s.request_id not in result.migrated)
        result.total_s = time.perf_counter() - t_start
        self.last_switch = per_rank
        logger.info("SGLang pool %s -> %s in %.3f s: %s; %d migrated, %d recomputed", src, dst, result.total_s,
                    {k: round(v, 4) for k, v in result.phase_s.items()}, len(result.migrated), len(result.recomputed))
        return result

    def _method(self, s: RequestState, dst: Layout) -> str:
        # SGLang freed nothing it had cached: every token but the last sampled one has KV in the radix tree.
        return handoff_method(self.config.kv_handoff, self.cost, self.spec, DTYPE_BYTES[self.config.dtype],
                              s.num_tokens - 1, dst.tp_size)

    def _submit(self, states: list[RequestState], assign: dict[str, int]) -> None:
        by_replica: dict[int, list[RequestState]] = {}
        for s in states:
            by_replica.setdefault(assign[s.request_id], []).append(s)
        for r, ss in sorted(by_replica.items()):
            self.client.import_requests(ss, replica=r)
            self._prefill_tokens += sum(s.num_tokens for s in ss)
            self._replica.update({s.request_id: r for s in ss})

    def _rollback(self, states: list[RequestState]) -> None:
        per_rank = self._rpc("pat_restore_base", path="")
        self.layout = self.base
        self.kv_tokens = min(r["kv_tokens"] for r in per_rank)
        self._submit(states, balance_states(states, self.base.num_replicas))

    # ---- weights, memory, info -------------------------------------------------------------------
    def update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        asyncio.set_event_loop(self.client.loop)
        if self.layout != self.base:
            raise RuntimeError(f"update_weights in layout {self.layout}; return to the base layout {self.base} first")
        try:
            self.client.update_weights(named_tensors, timeout=self.config.rpc_deadline_s())
        except TimeoutError as e:  # engine.EngineTimeout
            raise self._engine_timeout(e, "update_weights", []) from e
        self._backup_stale = True  # one backup per sync, not per bucket: end_weight_update (or the next switch)

    def end_weight_update(self) -> None:
        """A weight sync's last bucket is in: refresh the host backup rollback restores from (pinned, one copy per
        rank). Called once per sync (verl: after the last bucket; `resume(["kv_cache"])`, which follows it, calls
        it too); the next switch takes it itself if nobody did, so a rollback always restores the synced weights."""
        if self._backup_stale:
            self._rpc("pat_backup_base")
            self._backup_stale = False

    def release(self, tags: list[str]) -> None:
        """Free GPU memory between stages (SGLang's memory saver); without it there is nothing to release."""
        if not self.memory_saver:
            logger.debug("SglPool.release(%s): no memory saver (CPU or enable_memory_saver=False), kept", tags)
            return
        asyncio.set_event_loop(self.client.loop)
        try:
            self.client.release(tags, timeout=self.config.rpc_deadline_s())
        except TimeoutError as e:  # engine.EngineTimeout
            raise self._engine_timeout(e, "release", []) from e

    def resume(self, tags: list[str]) -> None:
        if "kv_cache" in tags:  # verl resumes the KV cache after the last weight bucket
            self.end_weight_update()
        if not self.memory_saver:
            return
        asyncio.set_event_loop(self.client.loop)
        try:
            self.client.resume(tags, timeout=self.config.rpc_deadline_s())
        except TimeoutError as e:  # engine.EngineTimeout
            raise self._engine_timeout(e, "resume", []) from e

    def info(self) -> list[dict[str, Any]]:
        return self._rpc("pat_pool_info", path="")

    def save_params(self, path: str) -> list[dict]:
        """Every rank's live SGLang parameters (its shard in the current layout), index = WORLD rank."""
        import torch

        self._rpc("pat_save_params", save_path=path)
        return [torch.load(f"{path}.rank{r}.pt", weights_only=False) for r in range(self.num_devices)]

    def fail_next(self, phase: str | None, rank: int | None = None, hang_s: float = 0.0) -> None:
        """Test hook: rank `rank` (None: every rank) raises in phase `phase` of the next switch (export, kv,
        reshard, switch = rebuild, import: `rank_rpc.FAULT_PHASES`) or of the next rollback ("rollback"),
        after hanging `hang_s` seconds if given (a hung scheduler)."""
        self._rpc("pat_fail_next", phase=phase, rank=rank, hang_s=hang_s)

    def shutdown(self) -> None:
        asyncio.set_event_loop(self.client.loop)
        try:
            self.client.shutdown()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)
