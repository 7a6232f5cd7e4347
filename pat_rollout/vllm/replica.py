"""`VllmReplica`: one replica of the current layout as one vLLM `LLMEngine` (v1) on the replica's devices.

The engine core runs in its own process (vLLM's default `VLLM_ENABLE_V1_MULTIPROCESSING=1`) with its workers;
this object is the driver-side client: it submits token-id requests, reads the engine core's outputs with a
deadline, and keeps every request's tokens and log-probs so far, so a switch can export them exactly (what this
replica returned, not what the engine core may have computed after) and the pool can resubmit them elsewhere.

Imports vllm: only in the vLLM venv (`make install-vllm`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pat_rollout.types import Request, RequestOutput, RequestState, SamplingParams

logger = logging.getLogger(__name__)

POLL_S = 0.02  # slice of a bounded wait for the engine core's next output (between liveness checks)
REAP_S = 30.0  # the most a stop waits for an engine's processes to be gone after vLLM's shutdown returned


@dataclass(slots=True)
class Tracked:
    """One request on a replica: its original prompt and budget, and the tokens and log-probs produced so far,
    `prefix_*` from earlier replicas (before a switch), `new_*` from this one."""

    request: Request
    prefix_ids: tuple[int, ...] = ()
    prefix_lps: tuple[float, ...] = ()
    new_ids: list[int] = field(default_factory=list)
    new_lps: list[float] = field(default_factory=list)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prefix_ids + tuple(self.new_ids)

    @property
    def num_tokens(self) -> int:
        """len(token_ids) without building it (read per request at every step)."""
        return len(self.prefix_ids) + len(self.new_ids)

    @property
    def log_probs(self) -> tuple[float, ...]:
        return self.prefix_lps + tuple(self.new_lps)

    def output(self, finish_reason: str) -> RequestOutput:
        return RequestOutput(request_id=self.request.request_id, prompt_token_ids=self.request.prompt_token_ids,
                             token_ids=self.token_ids, log_probs=self.log_probs, finish_reason=finish_reason)

    def state(self) -> RequestState:
        ids = self.token_ids
        return RequestState(request_id=self.request.request_id, prompt_token_ids=self.request.prompt_token_ids,
                            output_token_ids=ids, output_log_probs=self.log_probs, sampling=self.request.sampling,
                            num_cached_tokens=len(self.request.prompt_token_ids) + max(0, len(ids) - 1))


class EngineTimeout(TimeoutError):
    """The engine core produced no output within the deadline."""


class EngineGone(RuntimeError):
    """The engine core process is no longer alive (killed, crashed, or ended by vLLM after a worker died)."""


@contextlib.contextmanager
def patched_environ(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ while vLLM spawns the engine core (it and its workers inherit it), then restored."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def vllm_sampling(sp: SamplingParams, max_tokens: int, eos_token_ids: Sequence[int],
                  kv: dict[str, Any] | None = None) -> Any:
    """vLLM SamplingParams for ours: the sampled token's log-prob (`logprobs=0`, raw model log-probs), no detokenization
    (token ids in and out), each output carrying only the tokens new since the last (`DELTA`: with vLLM's default
    CUMULATIVE every step copies every request's whole output, O(response length) per request per step, in vLLM's
    output processor and again here). EOS comes from the checkpoint's config (the engine runs without a tokenizer),
    as stop token ids unless `ignore_eos`. `kv`: a migrated request's KV manifest, for the engine's
    `kv_connector.PatKVConnector` (`kv_transfer_params`). A seed is passed only when non-zero: vLLM then samples
    from a per-request generator seeded at admission (not reproducible across a resubmission; see README)."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    stop = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else tuple(eos_token_ids))
    return VSP(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
               seed=sp.seed or None, stop_token_ids=list(dict.fromkeys(stop)), ignore_eos=sp.ignore_eos,
               logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA,
               extra_args={"kv_transfer_params": {"pat_kv": kv}} if kv else None)


class VllmReplica:
    """One vLLM engine serving replica `index` of a layout on `devices` (TP = len(devices))."""

    def __init__(self, index: int, devices: tuple[int, ...], engine_args: dict[str, Any], env: dict[str, str],
                 eos_token_ids: Sequence[int] = ()) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.index, self.devices = index, tuple(devices)
        self.eos_token_ids = tuple(eos_token_ids)
        t0 = time.perf_counter()
        kw = dict(engine_args)
        if isinstance(kw.get("kv_transfer_config"), dict):
            from vllm.config import KVTransferConfig

            kw["kv_transfer_config"] = KVTransferConfig(**kw["kv_transfer_config"])
        args = EngineArgs(tensor_parallel_size=len(self.devices), **kw)
        with patched_environ(env):
            self.engine = LLMEngine.from_engine_args(args)
        self.startup_s = time.perf_counter() - t0
        cache = self.engine.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.num_blocks = int(cache.num_gpu_blocks or 0)
        self.tracked: dict[str, Tracked] = {}
        # request id -> prompt tokens the engine did not compute at the request's (re)admission here (vLLM's
        # num_cached_tokens: prefix-cache hits plus tokens a KV connector loaded), from its first output
        self.cached_tokens: dict[str, int] = {}

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ---- requests --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.resume(Tracked(request=request))

    def resume(self, t: Tracked, kv: dict[str, Any] | None = None) -> None:
        """Start `t` here: its prompt plus every token it produced so far is the new prompt, with the budget it has
        left; without `kv` it is recomputed, with `kv` (a migrated request's manifest, `kv_connector`) the engine
        loads the KV of all but the last token and prefills only that one."""
        from vllm.inputs import TokensPrompt

        rid = t.request.request_id
        ids = list(t.request.prompt_token_ids) + list(t.token_ids)
        left = t.request.sampling.max_new_tokens - len(t.token_ids)
        if left < 1:
            raise ValueError(f"request {rid!r} has no budget left ({len(t.token_ids)} tokens of "
                             f"{t.request.sampling.max_new_tokens})")
        t.prefix_ids, t.prefix_lps, t.new_ids, t.new_lps = t.token_ids, t.log_probs, [], []
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=ids),
                                vllm_sampling(t.request.sampling, left, self.eos_token_ids, kv))
        self.tracked[rid] = t
        self.cached_tokens.pop(rid, None)

    def busy(self) -> bool:
        return bool(self.tracked)

    def step(self, num_steps: int, deadline_s: float) -> tuple[list[RequestOutput], int]:
        """Read up to `num_steps` engine-core outputs (each is one scheduler step of the engine core, which runs on
        its own meanwhile), waiting at most `deadline_s` for each. Returns the finished requests and how many
        new tokens the busy requests received.

        An output of only requests this replica no longer tracks is not a step: the engine core runs ahead of the
        pool, so after an abort (`export`, `abort_all`) its queue still holds the steps it made for the aborted
        requests, as many as it ran ahead (thousands for a long request), and counting them would hand the
        requests submitted next steps without tokens."""
        finished: list[RequestOutput] = []
        decoded = 0
        steps = 0
        while steps < num_steps and self.tracked:
            self._wait_output(deadline_s)
            outs = [o for o in self.engine.step() if o.request_id in self.tracked]
            if not outs:
                continue
            steps += 1
            for o in outs:
                t = self.tracked[o.request_id]
                c = o.outputs[0]
                if o.request_id not in self.cached_tokens:
                    self.cached_tokens[o.request_id] = int(o.num_cached_tokens or 0)
                lps = [next(iter(d.values())).logprob if d else float("nan") for d in (c.logprobs or [])]
                if len(lps) != len(c.token_ids):
                    raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(c.token_ids)} new tokens "
                                       f"of request {o.request_id!r}")
                t.new_ids.extend(c.token_ids)  # DELTA outputs: the tokens since the last output
                t.new_lps.extend(lps)
                decoded += len(c.token_ids)
                if o.finished:
                    finished.append(t.output(c.finish_reason or "stop"))
                    del self.tracked[o.request_id]
        return finished, decoded

    def _wait_output(self, deadline_s: float) -> None:
        """Bounded wait: vLLM's `get_output` blocks on its queue without a timeout (SyncMPClient.get_output).
        Waits on the queue's own condition (`queue.Queue.not_empty`, notified by vLLM's output thread at each
        put), so it returns as soon as an output arrives, as the blocking `get` would, and wakes only every
        POLL_S otherwise, to check that the engine core process lives and the deadline."""
        queue = self.engine.engine_core.outputs_queue
        proc = _core_process(self.engine)
        end = time.monotonic() + deadline_s
        with queue.not_empty:  # queue.Queue's lock; `_qsize` is the size without taking it again
            while not queue._qsize():
                if not proc.is_alive():
                    raise EngineGone(f"vLLM replica {self.index} on devices {list(self.devices)}: the engine core "
                                     f"process (pid {proc.pid}) is gone, exit code {proc.exitcode}")
                left = end - time.monotonic()
                if left <= 0:
                    raise EngineTimeout(f"vLLM replica {self.index} on devices {list(self.devices)}: no engine-core "
                                        f"output within {deadline_s:.1f} s ({len(self.tracked)} requests running)")
                queue.not_empty.wait(min(POLL_S, left))

    def export(self, request_ids: Iterable[str] | None = None) -> list[Tracked]:
        """Abort `request_ids` (None: all) and hand back what this replica returned of each (exact tokens and
        log-probs so far). Outputs the engine core produced after the last read are dropped with the abort."""
        ids = list(self.tracked) if request_ids is None else [r for r in request_ids if r in self.tracked]
        if ids:
            self.engine.abort_request(ids)
        return [self.tracked.pop(r) for r in ids]

    def engine_core_pid(self) -> int:
        """The engine core's process id (vLLM's CoreEngineProcManager)."""
        return _core_process(self.engine).pid

    def processes(self) -> list[Any]:
        """The engine core's process and its workers' (psutil.Process), the core first; [] once stopped."""
        import psutil

        engine = getattr(self, "engine", None)  # None once stopped, absent if the engine failed to start
        if engine is None:
            return []
        try:
            core = psutil.Process(_core_process(engine).pid)
            return [core, *core.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rank_token_ids(self) -> list[dict[str, list[int]]]:
        """Per TP rank of this replica (index = rank): its persistent batch's token ids per request
        (`worker_ext.PatWorkerExtension.pat_token_ids`)."""
        return self.engine.collective_rpc("pat_token_ids")

    def save_kv(self, request_id: str, path: str, num_tokens: int, timeout_s: float) -> list[dict[str, Any] | None]:
        """Per TP rank (index = rank): write the KV of the first `num_tokens` tokens of `request_id` to
        `path`.rank<r> (`PatWorkerExtension.pat_save_kv`); None where the rank no longer holds it."""
        return self.engine.collective_rpc("pat_save_kv", timeout=timeout_s, args=(request_id, path, num_tokens))

    def kv_blocks(self, request_id: str) -> list[dict[str, Any]]:
        """Per TP rank of this replica (index = rank): every KV block of `request_id` as the rank stores it, per
        attention layer ("0", "1", ...) [blocks, this rank's KV heads, ...] (`PatWorkerExtension.pat_read_kv_blocks`;
        the KV hand-off's read, tests)."""
        from pat_rollout.vllm.worker_ext import unpack_tensors

        return [dict(unpack_tensors(p)) for p in self.engine.collective_rpc("pat_read_kv_blocks", args=(request_id,))]

    def reload_weights(self, weights_dir: str, timeout_s: float) -> None:
        """Every rank reloads its shards in place from the checkpoint in `weights_dir` (vLLM's worker method
        `reload_weights`: layerwise reload, the CPU repacking redone)."""
        self.engine.collective_rpc("reload_weights", timeout=timeout_s,
                                   kwargs={"weights_path": weights_dir, "is_checkpoint_format": True})

    def params(self, names: list[str]) -> list[dict[str, Any]]:
        """Per TP rank, its shards of the live parameters `names` (tests)."""
        from pat_rollout.vllm.worker_ext import unpack_tensors

        return [dict(unpack_tensors(p)) for p in self.engine.collective_rpc("pat_params", args=(names,))]

    def shutdown(self) -> None:
        """Stop the engine, and return only once its engine core and workers are gone: the workers hold the
        device memory (weights, KV) the next layout's engines profile at their start. vLLM's shutdown gives the
        workers a grace period (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s; ~4 s on this CPU), then SIGKILLs the
        engine core's process tree without waiting for it (`kill_process_tree`); so the engine core (our child) is
        joined here and its workers (its children) polled until gone or zombies (exited: their memory is free),
        at most REAP_S in all. On 8 GPUs that SIGKILL is also what ends a worker left blocked in an NCCL
        collective by a failed peer (a blocked kernel never reads the death pipe): a stop is bounded by vLLM's
        5 s grace plus REAP_S whatever the workers were doing. No tensor moves here; the driver process holds no
        device memory. What a CPU test cannot show: how soon a killed CUDA process's device memory is free, and
        that a worker stuck in NCCL dies on the SIGKILL rather than in driver teardown."""
        self.tracked.clear()
        self.cached_tokens.clear()
        workers = self.processes()[1:]
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        core = _core_process(engine)
        engine.engine_core.shutdown()
        end = time.monotonic() + REAP_S
        core.join(REAP_S)
        while alive := ([core.pid] if core.is_alive() else []) + [p.pid for p in workers if not process_exited(p)]:
            if time.monotonic() > end:
                raise RuntimeError(f"vLLM replica {self.index} on devices {list(self.devices)}: processes "
                                   f"{sorted(alive)} still running {REAP_S:.0f} s after the engine's shutdown")
            time.sleep(POLL_S)


def _core_process(engine: Any) -> Any:
    """The engine core's process of a vLLM LLMEngine (a multiprocessing.Process, a child of this one)."""
    return engine.engine_core.resources.engine_manager.processes[0]


def process_exited(proc: Any) -> bool:
    """A process (psutil) that is gone or a zombie (exited, waiting for its parent to reap it)."""
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
