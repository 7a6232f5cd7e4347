"""`VllmPool`: the driver's pool on real vLLM engines (`engine_kwargs.pat.backend=vllm`), first step.

Each replica of the current layout is one vLLM v1 engine (`replica.VllmReplica`, TP = the replica's group size)
placed on the replica's devices. A layout switch exports every unfinished request (exact tokens and log-probs
so far), stops the old layout's engines, starts the new layout's engines on the same devices and resubmits each
request (prompt + generated tokens, remaining budget): the hand-off is recomputation. A failure while starting
the new layout rolls back to the base layout's engines and resubmits every request there.

This is the stepping stone the README names: it serves every layout on real vLLM behind the Pool protocol and
switches mid-decode, but it re-creates engines at a switch (weights loaded again from the checkpoint, no KV kept).
The target design (long-lived workers regrouped per layout, weights resharded in place) is in README.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pat_rollout.config import PatRolloutConfig
from pat_rollout.driver.errors import PoolBrokenError, ReconfigurationError, WorkerError
from pat_rollout.driver.pool import Pool, ReconfigResult
from pat_rollout.engine.base import EngineSnapshot, RunningInfo, StepResult
from pat_rollout.kv.cost import HandoffCost
from pat_rollout.layout import Layout
from pat_rollout.types import ModelSpec, Request, RequestOutput
from pat_rollout.workers.reconfigure import balance_states

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `make install-vllm` (its own venv, .venv-vllm)"


def check_model(config: PatRolloutConfig) -> ModelSpec:
    """Fail before any process starts: vLLM importable, a HF config, TP sizes that divide the heads."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"backend='vllm' needs vLLM, which is not installed in this environment; {INSTALL_HINT}")
    spec = ModelSpec.from_model_path(config.model_path, config.tp_sizes)
    return spec


def cpu_bind(devices: Iterable[int], num_devices: int, cpus: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a replica on `devices` of a CPU pool: device d owns the d-th equal share of
    the allowed cores (one core each when there are no more cores than devices; a share wraps around when there
    are fewer), TP ranks separated by '|' as vLLM's CPU worker reads it."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    per = max(1, len(cpus) // num_devices)
    return "|".join(",".join(str(cpus[(d * per + i) % len(cpus)]) for i in range(per)) for d in devices)


def replica_env(devices: tuple[int, ...], num_devices: int, device: str) -> dict[str, str]:
    """The environment a replica's engine core and workers start with: its devices and nothing else."""
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if device == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(devices, num_devices)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


def replica_seed(seed: int, switches: int, replica: int) -> int:
    """The seed of replica `replica`'s engine after `switches` switches: vLLM seeds every worker of an engine
    with it (`set_random_seed(model_config.seed)`), so the ranks of a replica sample alike (fresh engines, equal
    RNG states), while replicas and layouts draw different random streams."""
    return (seed * 1_000_003 + switches * 1_009 + replica) % (2**31 - 1)


def stop_all(replicas: Sequence[Any]) -> list[tuple[int, Exception]]:
    """Stop every replica's engine at once (a thread each) and wait for all (`VllmReplica.shutdown` returns when its
    processes are gone): each stop waits out vLLM's grace for its workers (~4-5 s), so N engines stop in about one
    engine's time instead of N times it. Returns (replica index, error) for each stop that failed; the others are
    stopped."""
    import threading

    errors: list[tuple[int, Exception]] = []

    def stop(rep: Any) -> None:
        try:
            rep.shutdown()
        except Exception as e:  # reported by the caller; the other stops go on
            errors.append((rep.index, e))

    threads = [threading.Thread(target=stop, args=(rep,), name=f"pat-vllm-stop-{rep.index}") for rep in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def engine_args(config: PatRolloutConfig, spec: ModelSpec, **overrides: Any) -> dict[str, Any]:
    """vLLM EngineArgs of every replica (TP set per replica): token ids in and out (no tokenizer), eager mode
    (per-layout CUDA graphs are the target design's, not this step's), the pool's seed, `max_num_seqs` per
    replica; `config.engine_args` (any vLLM EngineArgs field, e.g. gpu_memory_utilization, max_model_len), then
    `overrides` (VllmPool's keyword arguments), override these."""
    kw: dict[str, Any] = dict(model=config.model_path, dtype=config.dtype, seed=config.seed, enforce_eager=True,
                              skip_tokenizer_init=True, max_num_seqs=config.max_num_seqs,
                              max_model_len=spec.max_position_embeddings, distributed_executor_backend="mp",
                              worker_extension_cls="pat_rollout.vllm.worker_ext.PatWorkerExtension",
                              kv_transfer_config=dict(kv_connector="PatKVConnector", kv_role="kv_consumer",
                                                      kv_connector_module_path="pat_rollout.vllm.kv_connector"))
    kw.update(config.engine_args)
    kw.update(overrides)
    return kw


def kv_manifest(request_id: str, files: list[dict[str, Any]], src_group: tuple[int, ...],
                dst_group: tuple[int, ...], num_kv_heads: int) -> dict[str, Any]:
    """The manifest `kv_connector.PatKVConnector` loads a migrated request's KV from: `files[k]` is what old rank k
    wrote (`PatWorkerExtension.pat_save_kv`: path, [blocks, its KV heads, ...], dtype); `kv.plan_kv` says which KV
    heads each new rank holds and which old rank has them (TP1 -> TP2: new rank h takes head h of the one file;
    TP2 -> TP1: the rank takes both files' heads). Per new rank: [{path, shape, dtype, src: [a, b] heads of that
    file, dst: first head of this rank's}]; "tokens": the migrated tokens, "bytes": what the new ranks read."""
    from pat_rollout.kv.plan import plan_kv
    from pat_rollout.layout.shard import kv_heads_for_rank

    tokens = {f["tokens"] for f in files}
    if len(tokens) != 1:
        raise RuntimeError(f"request {request_id!r}: the old ranks wrote different token counts {sorted(tokens)}")
    n = tokens.pop()
    ranks: list[list[dict[str, Any]]] = [[] for _ in dst_group]
    nbytes = 0
    for t in plan_kv([(request_id, src_group, dst_group, n)], num_kv_heads).transfers:
        i, k = src_group.index(t.src_device), dst_group.index(t.dst_device)
        a = t.kv_heads[0] - kv_heads_for_rank(num_kv_heads, i, len(src_group))[0]
        c = t.kv_heads[0] - kv_heads_for_rank(num_kv_heads, k, len(dst_group))[0]
        f = files[i]
        ranks[k].append({"path": f["path"], "shape": f["shape"], "dtype": f["dtype"], "src": [a, a + t.num_heads],
                         "dst": c})
        nbytes += f["bytes"] * t.num_heads // f["shape"][1]
    return {"tokens": n, "layers": files[0]["layers"], "ranks": ranks, "bytes": nbytes}


class VllmPool(Pool):
    """`config.num_devices` devices; one vLLM engine per replica of the current layout. Driver thread only."""

    reports_load = False  # snapshots are the pool's bookkeeping, not vLLM's scheduler state
    # update_weights reloads the current layout's engines, and later switches start engines from the updated
    # checkpoint, so any layout works
    weights_in_any_layout = True

    def __init__(self, config: PatRolloutConfig, spec: ModelSpec, base: Layout, *, cost: HandoffCost | None = None,
                 device: str | None = None, **overrides: Any) -> None:
        import torch

        self.config, self.spec, self.cost = config, spec, cost
        self.num_devices = config.num_devices
        self.base = self.layout = base
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.args = engine_args(config, spec, **overrides)
        self.replicas: list[Any] = []
        self.switches = 0
        self.fault: tuple[str, float] | None = None  # test hook (`fail_next`): (phase, seconds to hang first)
        self.held: list[RequestOutput] = []  # finished during a switch's KV import, not yet returned by `step`
        self.last_cached_tokens: dict[str, int] = {}  # the last switch: request -> tokens its new engine did not compute
        self.pending: dict[str, Any] = {}  # HF name -> CPU tensor: updates not yet in the engines
        self.weights_dir: str | None = None  # the pool's own checkpoint with every update so far (engines load it)
        t0 = time.perf_counter()
        self.replicas = self._start(base)
        self.startup_s = time.perf_counter() - t0
        logger.info("VllmPool up in %.1f s: %d devices on %s, layout %s", self.startup_s, self.num_devices,
                    self.device, base)

    # ---- engines ---------------------------------------------------------------------------------
    def _start(self, layout: Layout) -> list[Any]:
        """One engine per replica of `layout`, started one after another (vLLM reads the device placement from
        the environment its processes start with); if one fails, the started ones are stopped."""
        made: list[Any] = []
        try:
            for r, group in enumerate(layout.groups):
                if r == len(layout.groups) - 1:
                    self._maybe_fail("start", f"starting replica {r} of {layout}")
                made.append(self._new_replica(r, group))
        except BaseException:
            for i, e in stop_all(made):  # the start's error is the one raised
                logger.warning("VllmPool: stopping replica %d after a failed start failed too: %r", i, e)
            raise
        self.kv_tokens = min(rep.kv_tokens for rep in made)
        return made

    def _new_replica(self, r: int, group: tuple[int, ...]) -> Any:
        """Replica `r`'s engine on the devices of `group`, its sampler seeded for this switch and replica."""
        from pat_rollout.vllm.replica import VllmReplica

        args = {**self.args, "seed": replica_seed(self.args["seed"], self.switches, r)}
        return VllmReplica(r, group, args, replica_env(group, self.num_devices, self.device),
                           eos_token_ids=self.spec.eos_token_ids)

    def _stop(self) -> None:
        errors = [f"replica {i}: {e}" for i, e in stop_all(self.replicas)]
        self.replicas = []
        if errors:
            raise WorkerError(f"VllmPool: stopping engines failed: {errors}", list(range(self.num_devices)))

    # ---- serving ---------------------------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        prompt, spec = request.prompt_token_ids, self.spec
        if bad := [t for t in prompt if not 0 <= t < spec.vocab_size]:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:8]} outside vocab [0, {spec.vocab_size})")
        total = len(prompt) + request.sampling.max_new_tokens
        limit = min(self.args["max_model_len"], spec.max_position_embeddings)
        if total > limit:
            raise ValueError(f"request {request.request_id!r}: prompt {len(prompt)} + max_new_tokens "
                             f"{request.sampling.max_new_tokens} = {total} > max_model_len={limit}")
        if total > self.kv_tokens:
            raise ValueError(f"request {request.request_id!r} can never fit: {total} tokens > the "
                             f"{self.kv_tokens} KV tokens of one replica")

    def add_requests(self, per_replica: dict[int, list[Request]]) -> None:
        self._flush_weights()
        for r, reqs in per_replica.items():
            for q in reqs:
                self.replicas[r].add(q)

    def step(self, replicas: Iterable[int], num_steps: int) -> dict[int, tuple[StepResult, EngineSnapshot]]:
        self._flush_weights()
        out: dict[int, tuple[StepResult, EngineSnapshot]] = {}
        for r in replicas:
            held, self.held = self.held, []  # finished during the last switch's KV import: reported once, here
            rep = self.replicas[r]
            t0 = time.perf_counter()
            finished, decoded = self._step_replica(rep, num_steps, "decode step")
            out[r] = (StepResult(finished=tuple(held + finished), num_steps=num_steps, num_decode_tokens=decoded,
                                 num_prefill_tokens=0, num_running=len(rep.tracked), num_waiting=0,
                                 elapsed_s=time.perf_counter() - t0), self._snapshot(rep))
        return out

    def _step_replica(self, rep: Any, num_steps: int, what: str) -> tuple[list[RequestOutput], int]:
        """`num_steps` engine steps of `rep` under the RPC deadline of its running context, a hung or dead engine
        raised as WorkerError(unresponsive=True) naming its devices (the decode step and the switch's KV import)."""
        from pat_rollout.vllm.replica import EngineTimeout

        work = sum(len(t.request.prompt_token_ids) + t.num_tokens for t in rep.tracked.values())
        try:
            return rep.step(num_steps, self.config.rpc_deadline_s(work))
        except EngineTimeout as e:
            raise WorkerError(f"VllmPool {what}: {e} (PatRolloutConfig.rpc_deadline_s)", list(rep.devices),
                              unresponsive=True) from e
        except Exception as e:  # vLLM's EngineDeadError: an engine-core or worker process died
            raise WorkerError(f"VllmPool {what} on replica {rep.index} (devices {list(rep.devices)}): {e!r}",
                              list(rep.devices), unresponsive=True) from e

    def _snapshot(self, rep: Any) -> EngineSnapshot:
        running = tuple(RunningInfo(request_id=rid, num_prompt_tokens=len(t.request.prompt_token_ids),
                                    num_output_tokens=t.num_tokens,
                                    max_new_tokens=t.request.sampling.max_new_tokens)
                        for rid, t in rep.tracked.items())
        used = sum(-(-(i.num_prompt_tokens + i.num_output_tokens) // rep.block_size) for i in running)
        return EngineSnapshot(running=running, num_waiting=0, num_total_blocks=rep.num_blocks,
                              num_free_blocks=max(0, rep.num_blocks - used), block_size=rep.block_size)

    def abort_all(self) -> list[RequestOutput]:
        held, self.held = self.held, []
        return held + [t.output("abort") for rep in self.replicas for t in rep.export()]

    # ---- reconfiguration -------------------------------------------------------------------------
    def layout_for(self, tp: int) -> Layout:
        self.spec.check_tp(tp)
        if tp not in self.config.tp_sizes:
            raise ValueError(f"TP{tp} is not one of this pool's TP sizes {self.config.tp_sizes}")
        return Layout.uniform(self.num_devices, tp)

    # Phases of a switch, in order; `fail_next` injects a fault into one (tests).
    PHASES = ("export", "stop", "start", "import", "kv_import")

    def fail_next(self, phase: str, hang_s: float = 0.0) -> None:
        """Test hook: the next switch raises in `phase` (one of PHASES), after hanging `hang_s` seconds if given.
        export and stop fail after the first replica's export / stop (some done, some not), start when the new
        layout's last engine starts (the others started), import after the first request was resubmitted, kv_import
        with a real fault: the first migrated request's KV files are deleted before the new engine loads them (its
        worker's load raises and the engine dies; a switch migrating nothing does not fail)."""
        if phase not in self.PHASES:
            raise ValueError(f"unknown switch phase {phase!r}; one of {self.PHASES}")
        self.fault = (phase, hang_s)

    def _maybe_fail(self, phase: str, where: str) -> None:
        if self.fault is None or self.fault[0] != phase:
            return
        hang_s = self.fault[1]
        self.fault = None
        if hang_s:
            time.sleep(hang_s)
        raise RuntimeError(f"injected failure in VllmPool switch phase {phase!r} {where}")

    def reconfigure(self, dst_tp: int, assignment: dict[str, int]) -> ReconfigResult:
        """Export every unfinished request (exact tokens so far; for the requests the cost model migrates, their KV
        per old rank first, `_save_kv`), stop the old layout's engines, start the new layout's, resubmit every
        request there (migrated ones with their KV manifest, the rest recomputed), then step the new engines until
        every migrated request has loaded its KV and produced a token (`kv_import`). A failure in any phase rolls
        back to the old layout (`_roll_back`: its engines that still run are kept, the stopped ones start again,
        every request goes back to its replica, recomputed) and raises ReconfigurationError naming the phase; a
        failed rollback is PoolBrokenError."""
        import shutil

        t_start = time.perf_counter()
        src, dst = self.layout, self.layout_for(dst_tp)
        self._flush_weights()  # the new engines start from the pool's checkpoint
        result = ReconfigResult(src=src, dst=dst)
        self.switches += 1
        old = list(self.replicas)  # src's engines, by replica index
        exported: list[tuple[int, Any]] = []  # (replica of src, tracked request)
        kv_dir = self._kv_dir()
        phase = "export"
        try:
            t = time.perf_counter()
            on = {rid: rep.index for rep in old for rid in rep.tracked}
            states = [tr.state() for rep in old for tr in rep.tracked.values()]
            new_assign = balance_states(states, dst.num_replicas)
            chosen = self._choose_migrations(states, dst, new_assign)
            saved: dict[str, list[Any]] = {}  # request id -> per old rank: its file's description
            for rep in old:
                saved.update(self._save_kv(rep, [s for s in states if s.request_id in chosen
                                                 and on[s.request_id] == rep.index], kv_dir))
                exported += [(rep.index, tr) for tr in rep.export()]
                self._maybe_fail("export", f"after exporting replica {rep.index}")
            manifests = {rid: kv_manifest(rid, files, src.groups[on[rid]], dst.groups[new_assign[rid]],
                                          self.spec.num_kv_heads) for rid, files in saved.items()}
            result.phase_s["export"] = time.perf_counter() - t
            phase, t = "stop", time.perf_counter()
            if self.fault is not None and self.fault[0] == "stop":  # test hook: a fault after the first stop
                old[0].shutdown()
                self._maybe_fail("stop", f"after stopping replica {old[0].index}")
            if errors := stop_all(old):  # all at once
                raise RuntimeError(f"stopping the old layout's engines: {errors}")
            self.replicas = []
            result.phase_s["stop"] = time.perf_counter() - t
            phase, t = "start", time.perf_counter()
            self.replicas = self._start(dst)
            self.layout = dst
            result.phase_s["start"] = time.perf_counter() - t
            phase, t = "import", time.perf_counter()
            for n, (_, tr) in enumerate(exported):
                rid = tr.request.request_id
                self.replicas[new_assign[rid]].resume(tr, manifests.get(rid))
                if n == 0:
                    self._maybe_fail("import", f"after resubmitting request {rid!r}")
            result.phase_s["import"] = time.perf_counter() - t
            phase, t = "kv_import", time.perf_counter()
            if self.fault is not None and self.fault[0] == "kv_import" and manifests:
                self.fault = None  # a real fault: the first migrated request's KV files vanish before the load
                for f in next(iter(manifests.values()))["ranks"][0]:
                    os.unlink(f["path"])
            self._import_kv({rid: new_assign[rid] for rid in manifests})
            result.phase_s["kv_import"] = time.perf_counter() - t
        except Exception as e:
            err = self._roll_back(src, old, exported, f"vLLM switch {src} -> TP{dst_tp}", phase, e)
            err.assignment = {rid: r for rid, r in err.assignment.items() if rid in assignment}
            raise err from e
        finally:
            shutil.rmtree(kv_dir, ignore_errors=True)
        result.assignment = {rid: new_assign[rid] for rid in assignment if rid in new_assign}
        cached = {rid: c for rep in self.replicas for rid, c in rep.cached_tokens.items()}
        # migrated: the new engine reported the migrated tokens as not computed (vLLM's num_cached_tokens)
        result.migrated = tuple(rid for rid, m in manifests.items() if cached.get(rid, 0) >= m["tokens"])
        result.import_fallbacks = tuple(rid for rid in manifests if rid not in result.migrated)
        result.recomputed = tuple(s.request_id for s in states if s.request_id not in result.migrated
                                  and s.request_id in new_assign)
        result.kv_bytes_received = sum(m["bytes"] for rid, m in manifests.items() if rid in result.migrated)
        self.last_cached_tokens = cached
        result.total_s = time.perf_counter() - t_start
        logger.info("vLLM pool %s -> %s in %.3f s: %s; %d migrated, %d recomputed", src, dst, result.total_s,
                    {k: round(v, 4) for k, v in result.phase_s.items()}, len(result.migrated), len(result.recomputed))
        return result

    def _kv_dir(self) -> str:
        """A switch's folder for the migrated KV (host memory: /dev/shm where there is one); removed at its end."""
        import tempfile

        return tempfile.mkdtemp(prefix="pat-vllm-kv-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)

    def _choose_migrations(self, states: list[Any], dst: Layout, new_assign: dict[str, int]) -> set[str]:
        """The requests whose KV is migrated: the cost model's choice (`kv.cost` through
        `workers.reconfigure.handoff_method`, the rule every pool uses; `config.kv_handoff` forces one), over the
        tokens with KV (context - 1), then bounded by `config.kv_handoff_cap()` bytes per receiving device
        (`limit_by_memory`). kv_handoff="auto" without measured constants (cost None) recomputes."""
        from pat_rollout.config import DTYPE_BYTES
        from pat_rollout.workers.reconfigure import handoff_method, limit_by_memory

        mode, dtype_bytes = self.config.kv_handoff, DTYPE_BYTES[self.config.dtype]
        if mode == "auto" and self.cost is None:
            return set()
        picked = [s for s in states if s.num_tokens > 1 and handoff_method(
            mode, self.cost, self.spec, dtype_bytes, s.num_tokens - 1, dst.tp_size) == "migrate"]
        picked, _ = limit_by_memory(picked, lambda s: s.num_tokens - 1,
                                    {s.request_id: dst.groups[new_assign[s.request_id]] for s in picked},
                                    lambda tp: self.spec.kv_bytes_per_token(tp, dtype_bytes),
                                    self.config.kv_handoff_cap())
        return {s.request_id for s in picked}

    def _save_kv(self, rep: Any, states: list[Any], kv_dir: str) -> dict[str, list[Any]]:
        """Every rank of old replica `rep` writes the KV of each of `states` (all tokens but the last) to a file of
        `kv_dir`, one request and one layer at a time (`PatWorkerExtension.pat_save_kv`). A request a rank no longer
        holds (finished in the engine core after the pool's last read) is left out: it is recomputed."""
        out: dict[str, list[Any]] = {}
        for i, s in enumerate(states):
            path = os.path.join(kv_dir, f"r{rep.index}-{i}")
            files = rep.save_kv(s.request_id, path, s.num_tokens - 1, self.config.rpc_deadline_s(s.num_tokens))
            if all(f is not None for f in files):
                out[s.request_id] = files
            else:
                logger.info("vLLM switch: request %r is no longer on replica %d's workers: recomputed",
                            s.request_id, rep.index)
        return out

    def _import_kv(self, where: dict[str, int]) -> None:
        """Step the new replicas that received migrated requests (`where`: request id -> replica) until each of
        those has its first output there: its KV loaded by the engine's connector and its last token prefilled, so
        a failed load fails the switch (phase kv_import) rather than a later step. Requests finishing meanwhile are
        held and reported by the next `step`."""
        for r in sorted(set(where.values())):
            rep = self.replicas[r]
            want = {rid for rid, rr in where.items() if rr == r}
            rounds = sum(t.request.sampling.max_new_tokens for t in rep.tracked.values()) + 1
            while want - rep.cached_tokens.keys() and rep.busy() and rounds > 0:
                finished, _ = self._step_replica(rep, 1, "KV import")
                self.held += finished
                rounds -= 1
            if missing := want - rep.cached_tokens.keys():
                raise RuntimeError(f"replica {r}: migrated requests {sorted(missing)} produced no output")

    def _roll_back(self, src: Layout, old: list[Any], exported: list[tuple[int, Any]], what: str, phase: str,
                   cause: Exception) -> ReconfigurationError:
        """Back to `src` after a switch failed in `phase`: the new layout's engines (if any) stop, src's engines
        that still run are kept (an engine of `old` with no engine object was stopped), the others start again,
        and every exported request is resubmitted to its src replica (recomputation). Returns the
        ReconfigurationError to raise; PoolBrokenError if the pool cannot get back."""
        try:
            new = [rep for rep in self.replicas if all(rep is not o for o in old)]
            if errors := stop_all(new):
                raise RuntimeError(f"stopping the new layout's engines: {errors}")
            replicas: list[Any] = []
            restarted = 0
            for rep in old:
                if rep.engine is not None:
                    replicas.append(rep)
                    continue
                restarted += 1
                replicas.append(self._new_replica(rep.index, src.groups[rep.index]))
            self.replicas, self.layout = replicas, src
            self.kv_tokens = min(rep.kv_tokens for rep in replicas)
            held = {o.request_id for o in self.held}  # finished on the new layout during its KV import
            for r, tr in exported:
                if tr.request.request_id not in held:
                    self.replicas[r].resume(tr)
        except Exception as e2:
            stop_all(self.replicas)  # best effort: the pool is broken anyway
            raise PoolBrokenError(f"{what} failed in phase {phase} ({cause!r}), and rolling back to {src} failed "
                                  f"({e2!r}); the pool is broken") from e2
        assignment = {rid: rep.index for rep in self.replicas for rid in rep.tracked}
        return ReconfigurationError(f"{what} failed in phase {phase} ({cause!r}); rolled back to the old layout "
                                    f"{src} ({restarted} engines restarted), {len(exported)} of {len(assignment)} "
                                    f"unfinished requests resubmitted there for recomputation", assignment)

    # ---- weights, memory, info -------------------------------------------------------------------
    def update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Full HF-named tensors (one bucket of an update), kept on the host until the pool next serves
        (`_flush_weights`): vLLM's layerwise reload needs every tensor of a fused parameter (q, k, v of qkv_proj)
        in one reload, and a bucket may hold only some of them. Any layout: the engines of whatever layout the
        pool is in reload, and later switches start engines from the updated checkpoint."""
        for name, t in named_tensors:
            self.pending[name] = t.detach().to("cpu", copy=True)

    def _flush_weights(self) -> None:
        """Write the current checkpoint with the pending tensors in place of its own into a new folder of the
        pool's (same files, same names), have every engine reload from it, and start later engines from it.
        Costs a checkpoint write per update (this step's price; the target design loads in place)."""
        if not self.pending:
            return
        import shutil
        import tempfile

        from safetensors.torch import load_file, save_file

        src = Path(self.args["model"])
        dst = Path(tempfile.mkdtemp(prefix="pat-vllm-weights-"))
        left = dict(self.pending)
        try:
            for f in sorted(src.iterdir()):
                if f.suffix != ".safetensors":
                    if f.is_file():
                        shutil.copy(f, dst / f.name)
                    continue
                tensors = load_file(str(f))
                for name in tensors.keys() & left.keys():
                    new = left.pop(name)
                    if new.shape != tensors[name].shape:
                        raise ValueError(f"update_weights: {name} has shape {tuple(new.shape)}, the checkpoint's "
                                         f"is {tuple(tensors[name].shape)}")
                    tensors[name] = new.to(tensors[name].dtype).contiguous()
                save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
            if left:
                raise ValueError(f"update_weights: {sorted(left)[:8]} are not in the checkpoint {src}")
            for rep in self.replicas:
                try:
                    rep.reload_weights(str(dst), self.config.rpc_deadline_s())
                except Exception as e:
                    raise WorkerError(f"VllmPool update_weights on replica {rep.index} (devices "
                                      f"{list(rep.devices)}): {e!r}", list(rep.devices), unresponsive=True) from e
        except BaseException:
            shutil.rmtree(dst, ignore_errors=True)
            raise
        old, self.weights_dir, self.args["model"] = self.weights_dir, str(dst), str(dst)
        self.pending.clear()
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def release(self, tags: list[str]) -> None:
        logger.debug("VllmPool.release(%s): not supported yet (vLLM sleep mode), kept", tags)

    def resume(self, tags: list[str]) -> None:
        return None

    def info(self) -> list[dict[str, Any]]:
        out = []
        for rep in self.replicas:
            for rank, d in enumerate(rep.devices):
                out.append({"device": d, "replica": rep.index, "tp_rank": rank, "layout": str(self.layout),
                            "groups": [list(g) for g in self.layout.groups], "kv_tokens": rep.kv_tokens})
        return sorted(out, key=lambda i: i["device"])

    def shutdown(self) -> None:
        import shutil

        try:
            self._stop()
        finally:
            if self.weights_dir:
                shutil.rmtree(self.weights_dir, ignore_errors=True)
