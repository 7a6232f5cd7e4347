"""pat_rollout's Engine protocol on one real SGLang engine (one replica: `tp_size` scheduler processes).

Recompute path: `export_requests` aborts the chosen requests and takes the exact tokens and log-probs
SGLang returns with the abort; `import_requests` resubmits prompt + generated
tokens with the remaining budget, so the receiving engine re-prefills them (greedy continuation is
unchanged). KV migration (`export_kv`, `import_requests(kv=...)`) is not implemented on this backend yet.

SGLang decodes in its own scheduler processes, so `step(n)` observes progress (waits until every running
request has n more tokens or finished) rather than driving single iterations. See README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pat_rollout.driver.errors import WorkerError
from pat_rollout.engine.base import Engine, EngineSnapshot, RunningInfo, StepResult
from pat_rollout.sglang import compat, inventory
from pat_rollout.sglang.launch import launch_engine
from pat_rollout.sglang.replica_input import make_rid
from pat_rollout.types import Request, RequestOutput, RequestState, SamplingParams

if TYPE_CHECKING:
    import torch

_FINISH_REASONS = {"length": "length", "stop": "stop", "abort": "abort"}


@dataclass(slots=True)
class _Tracked:
    """One request as this engine sees it. `carried_*` came from an earlier engine (recompute path)."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    rid: str
    carried_ids: tuple[int, ...] = ()
    carried_log_probs: tuple[float, ...] = ()
    new_ids: list[int] = field(default_factory=list)
    new_log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    task: asyncio.Task | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.carried_ids) + len(self.new_ids)

    @property
    def output_ids(self) -> tuple[int, ...]:
        return self.carried_ids + tuple(self.new_ids)

    @property
    def output_log_probs(self) -> tuple[float, ...]:
        return self.carried_log_probs + tuple(self.new_log_probs)

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        """Append the tokens of one stream chunk that are new; the work is bounded by their number (copying the
        whole output on every chunk is O(L^2) per request).

        `completion_tokens` (this submission's total so far) says how many are new, and they are the tails of
        `output_ids` and `output_token_logprobs`: with `incremental_streaming_output` (launch.server_kwargs)
        the lists hold the tokens since the previous chunk, except SGLang's abort echo for a request aborted
        outside a batch (`_handle_abort_req`, both versions), which re-sends the last token already streamed
        beside the whole log-prob list; a cumulative stream's lists hold everything so far."""
        meta = chunk["meta_info"]
        ids, lps = chunk["output_ids"], meta["output_token_logprobs"]
        num_new = int(meta["completion_tokens"]) - len(self.new_ids)
        if not 0 <= num_new <= min(len(ids), len(lps)):
            raise RuntimeError(f"request {self.request_id!r} (rid {self.rid}): SGLang stream chunk with "
                               f"{len(ids)} token ids and {len(lps)} log-probs says completion_tokens="
                               f"{meta['completion_tokens']} after {len(self.new_ids)} streamed tokens")
        if num_new:
            self.new_ids.extend(ids[len(ids) - num_new:])
            self.new_log_probs.extend(lp for lp, _tid, _text in lps[len(lps) - num_new:])
        if meta.get("finish_reason") is not None:
            self.finish_reason = _FINISH_REASONS[meta["finish_reason"]["type"]]

    def to_output(self) -> RequestOutput:
        assert self.finish_reason is not None
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt, token_ids=self.output_ids,
                             log_probs=self.output_log_probs, finish_reason=self.finish_reason)


class EngineTimeout(TimeoutError):
    """An engine call the driver waits on (step, export, abort) ran past its deadline."""


def sglang_sampling_params(sp: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """pat_rollout SamplingParams -> SGLang's sampling_params dict."""
    out: dict[str, Any] = dict(max_new_tokens=max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                               top_k=sp.top_k, ignore_eos=sp.ignore_eos)
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    # SGLang uses it only under enable_deterministic_inference (not on the CPU backend): see README.md, "Sampling"
    if not sp.is_greedy:
        out["sampling_seed"] = sp.seed
    return out


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


class SGLangEngine(Engine):
    """A replica backed by `sglang.srt.entrypoints.engine.Engine` (token ids in/out, no tokenizer).

    Not thread-safe: every method runs SGLang's asyncio loop on the calling thread until its work is done.
    Several SGLangEngine objects may live in one process (each has its own scheduler processes and ports).
    """

    def __init__(self, model_path: str, *, tp_size: int = 1, device: str = "cpu", sgl: Any = None,
                 eos_token_ids: tuple[int, ...] = (), **server_overrides: Any):
        """`sgl`: an already launched `sglang.Engine` to drive (SglPool); otherwise one is launched here.
        `eos_token_ids`: the model's EOS ids (an export tells a request that stopped at EOS from a running one)."""
        self.model_path = model_path
        self.tp_size = tp_size
        self.eos_token_ids = tuple(eos_token_ids)
        t0 = time.perf_counter()
        before = _child_pids()
        self.sgl = sgl if sgl is not None else launch_engine(model_path, tp_size=tp_size, device=device,
                                                             **server_overrides)
        self.startup_s = time.perf_counter() - t0
        # The processes this launch started (schedulers, detokenizer): checked in every bounded wait
        self._children = sorted(_child_pids() - before) if sgl is None else []
        if moved := inventory.check_live(inventory.ENGINE, engine=self.sgl):
            self.sgl.shutdown()
            raise RuntimeError(inventory.error_message(moved, "checked on the started sglang.Engine"))
        self.loop: asyncio.AbstractEventLoop = self.sgl.loop
        self._tracked: dict[str, _Tracked] = {}
        self._finished: list[RequestOutput] = []
        # request id -> tokens SGLang found in its prefix cache, one entry per submission (a migrated request
        # continues on its cached KV: its later submissions show the migrated prefix here).
        self.cached_tokens: dict[str, list[int]] = {}
        # Called in every slice of a bounded wait (`_run`): the dead-child check here, SglPool's per-rank one there.
        self.watch: Callable[[str], None] | None = self._check_children if self._children else None
        info = self.sgl._scheduler_init_result.scheduler_infos[0]
        self.max_total_num_tokens = int(info["max_total_num_tokens"])

    def _check_children(self, what: str) -> None:
        """WorkerError(unresponsive) when a process this engine started is gone (its SIGQUIT is only logged:
        `rank_rpc.child_failed`)."""
        from pat_rollout.sglang.rank_rpc import is_gone

        if dead := [pid for pid in self._children if is_gone(pid)]:
            raise WorkerError(f"SGLang engine {what}: its child process(es) {dead} died", [0], unresponsive=True)

    # ---- submission ------------------------------------------------------------------------------
    def add_requests(self, requests: Iterable[Request], replica: int = 0) -> None:
        """`replica`: which replica of an SglPool serves them (it is encoded in SGLang's rid)."""
        for r in requests:
            self._submit(_Tracked(request_id=r.request_id, prompt=r.prompt_token_ids, sampling=r.sampling,
                                  rid=make_rid(replica, uuid.uuid4().hex)))

    def import_requests(self, states: Iterable[RequestState], kv: dict[str, torch.Tensor] | None = None,
                        replica: int = 0) -> None:
        """Continue exported requests: prompt + generated tokens are prefilled here, except the prefix SGLang's
        radix cache already holds (an SglPool switch puts migrated KV there)."""
        if kv:
            raise NotImplementedError("SGLangEngine: KV migration is not implemented; import without kv "
                                      "(recompute path)")
        for s in states:
            if s.remaining_budget <= 0:
                raise ValueError(f"request {s.request_id!r}: remaining_budget={s.remaining_budget} "
                                 f"(max_new_tokens={s.sampling.max_new_tokens}, "
                                 f"generated={len(s.output_token_ids)}): nothing left to continue")
            self._submit(_Tracked(request_id=s.request_id, prompt=s.prompt_token_ids, sampling=s.sampling,
                                  rid=make_rid(replica, uuid.uuid4().hex), carried_ids=s.output_token_ids,
                                  carried_log_probs=s.output_log_probs))

    def _submit(self, t: _Tracked) -> None:
        if t.request_id in self._tracked:
            raise ValueError(f"request {t.request_id!r} is already running on this engine")
        self._tracked[t.request_id] = t
        # rid is a fixed-length uuid: SGLang's abort matches rids by prefix.
        t.task = self.loop.create_task(self._consume(t))

    async def _consume(self, t: _Tracked) -> None:
        max_new = t.sampling.max_new_tokens - len(t.carried_ids)
        gen = await self.sgl.async_generate(
            input_ids=list(t.prompt + t.carried_ids), sampling_params=sglang_sampling_params(t.sampling, max_new),
            return_logprob=True, stream=True, rid=t.rid)
        async for chunk in gen:
            t.add_chunk(chunk)
            if t.finish_reason is not None:
                cached = int(chunk["meta_info"].get("cached_tokens", 0))
                self.cached_tokens.setdefault(t.request_id, []).append(cached)

    # ---- progress --------------------------------------------------------------------------------
    def step(self, num_steps: int = 1, timeout: float | None = None) -> StepResult:
        """Wait until every running request has `num_steps` more tokens or has finished (`timeout`: see `_run`)."""
        t0 = time.perf_counter()
        running = [t for t in self._tracked.values() if t.task is not None]
        start = {t.request_id: len(t.new_ids) for t in running}

        async def progressed() -> None:
            while any(not t.task.done() and len(t.new_ids) - start[t.request_id] < num_steps for t in running):
                await asyncio.sleep(0.002)

        self._run(progressed(), f"step({num_steps})", timeout)
        self._collect_done()
        finished, self._finished = tuple(self._finished), []
        return StepResult(finished=finished, num_steps=num_steps,
                          num_decode_tokens=sum(len(t.new_ids) - start[t.request_id] for t in running),
                          num_prefill_tokens=0, num_running=len(self._tracked), num_waiting=0,
                          elapsed_s=time.perf_counter() - t0)

    def _collect_done(self) -> None:
        for rid, t in list(self._tracked.items()):
            if t.task is not None and t.task.done():
                t.task.result()  # re-raise errors from the stream
                del self._tracked[rid]
                self._finished.append(t.to_output())

    def _run(self, aw: Any, what: str, timeout: float | None) -> Any:
        """Run `aw` on SGLang's loop. With `timeout`, give up after that many seconds (EngineTimeout); every
        slice of the wait calls `self.watch(what)` if set (SglPool: raises when a scheduler process died)."""
        if timeout is None and self.watch is None:
            return self.loop.run_until_complete(aw)

        async def guarded() -> Any:
            task = asyncio.ensure_future(aw)
            t_end = None if timeout is None else time.monotonic() + timeout
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    return task.result()
                try:
                    if self.watch is not None:
                        self.watch(what)
                    if t_end is not None and time.monotonic() > t_end:
                        raise EngineTimeout(f"SGLang engine call {what} did not finish within {timeout:.1f} s")
                except BaseException:
                    task.cancel()
                    raise

        return self.loop.run_until_complete(guarded())

    @contextlib.contextmanager
    def bounded(self, what: str, timeout: float | None) -> Iterator[None]:
        """Bound the `sglang.Engine` methods called inside (update_weights_from_tensor, release/resume_memory_
        occupation): each ends in `self.sgl.loop.run_until_complete(...)`, so `sgl.loop` is swapped for a proxy
        whose `run_until_complete` is `_run` with this deadline and the watch hook."""
        real, engine = self.sgl.loop, self

        class _BoundedLoop:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def run_until_complete(self, aw: Any) -> Any:
                return engine._run(aw, what, timeout)

        self.sgl.loop = _BoundedLoop()
        try:
            yield
        finally:
            self.sgl.loop = real

    def run_to_completion(self, timeout: float | None = None) -> list[RequestOutput]:
        """Run until every request finished; return all outputs not yet returned by `step`."""
        tasks = [t.task for t in self._tracked.values() if t.task is not None]
        if tasks:
            self._run(asyncio.gather(*tasks), "run_to_completion", timeout)
        self._collect_done()
        out, self._finished = self._finished, []
        return out

    def output_lengths(self) -> dict[str, int]:
        """Tokens generated so far per unfinished request (as last streamed)."""
        return {rid: t.num_output_tokens for rid, t in self._tracked.items()}

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def snapshot(self) -> EngineSnapshot:
        """Progress as last streamed. KV usage is an estimate (prompt + generated tokens of running
        requests; prefix sharing in SGLang's radix cache is not counted), in 1-token blocks."""
        running = tuple(RunningInfo(request_id=t.request_id, num_prompt_tokens=len(t.prompt),
                                    num_output_tokens=t.num_output_tokens, max_new_tokens=t.sampling.max_new_tokens)
                        for t in self._tracked.values() if t.finish_reason is None)
        used = sum(r.num_prompt_tokens + r.num_output_tokens for r in running)
        return EngineSnapshot(running=running, num_waiting=0, num_free_blocks=max(0, self.max_total_num_tokens - used),
                              num_total_blocks=self.max_total_num_tokens, block_size=1)

    # ---- export (recompute path) -------------------------------------------------------------------
    def export_requests(self, request_ids: Iterable[str] | None = None,
                        timeout: float | None = None) -> list[RequestState]:
        """Abort the requests and take the exact tokens/log-probs SGLang returns with the abort.

        No pause: a paused (`in_place`) scheduler never runs the step that retires aborted running
        requests, so their final chunk would not arrive until `continue_generation`. A request that
        finishes on its own before the abort lands is returned by the next `step` / `run_to_completion`
        instead. `num_cached_tokens` is 0: SGLang frees the KV of aborted requests."""
        wanted = list(self._tracked) if request_ids is None else list(request_ids)
        missing = [r for r in wanted if r not in self._tracked]
        if missing:
            raise ValueError(f"export_requests: unknown request ids {missing}; running: {sorted(self._tracked)}")
        tm = self.sgl.tokenizer_manager
        chosen = [self._tracked[r] for r in wanted]
        for t in chosen:
            if not t.task.done():
                tm.abort_request(rid=t.rid)
        self._run(asyncio.gather(*(t.task for t in chosen)), "export_requests (abort)", timeout)
        states = []
        for t in chosen:
            if t.finish_reason == "abort" and (done := self._complete(t)):
                t.finish_reason = done  # the abort arrived with the final token: finished, nothing to continue
            if t.finish_reason != "abort":  # finished by itself (length/stop) before the abort landed
                continue
            del self._tracked[t.request_id]
            states.append(RequestState(request_id=t.request_id, prompt_token_ids=t.prompt,
                                       output_token_ids=t.output_ids, output_log_probs=t.output_log_probs,
                                       sampling=t.sampling, num_cached_tokens=0))
        return states

    def _complete(self, t: _Tracked) -> str | None:
        """Why a request whose stream ended in an abort had in fact finished: its budget is used up or its
        last token stops it (SGLang reports an abort that lands in the step sampling the final token as
        "abort" with every token). None when it still has tokens to generate."""
        ids, sp = t.output_ids, t.sampling
        if ids and ((not sp.ignore_eos and ids[-1] in self.eos_token_ids) or ids[-1] in sp.stop_token_ids):
            return "stop"
        return "length" if len(ids) >= sp.max_new_tokens else None

    def export_kv(self, request_id: str, kv_heads: tuple[int, int]) -> torch.Tensor:
        raise NotImplementedError("SGLangEngine: KV export is not implemented (the recompute path needs none)")

    def free_exported(self) -> None:
        """Nothing to free: SGLang already released the KV of exported (aborted) requests."""

    def abort_all(self, timeout: float | None = None) -> list[RequestOutput]:
        self.sgl.tokenizer_manager.abort_request(abort_all=True)
        return self.run_to_completion(timeout)

    # ---- weights and memory ------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], timeout: float | None = None) -> None:
        """Full HF-named tensors; every rank's `weight_loader` keeps its shard (SGLang load_format=None)."""
        with self.bounded("update_weights", timeout), compat.weight_update_context(self.sgl):
            ok, msg = self.sgl.update_weights_from_tensor(list(named_tensors))
        if not ok:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed on {self.model_path} tp={self.tp_size}: "
                               f"{msg}")

    def release(self, tags: Iterable[str] = ("weights", "kv_cache"), timeout: float | None = None) -> None:
        """Needs SGLang's memory saver (CUDA; launch with enable_memory_saver=True)."""
        with self.bounded("release", timeout):
            self.sgl.release_memory_occupation(list(tags))

    def resume(self, tags: Iterable[str] = ("weights", "kv_cache"), timeout: float | None = None) -> None:
        with self.bounded("resume", timeout):
            self.sgl.resume_memory_occupation(list(tags))

    def shutdown(self) -> None:
        for t in self._tracked.values():
            if t.task is not None and not t.task.done():
                t.task.cancel()
        self._tracked.clear()
        self.sgl.shutdown()
