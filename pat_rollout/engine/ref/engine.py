"""RefEngine: the plain-PyTorch CPU engine every PAT mechanism runs on (one TP rank, SPMD)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable

import torch

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.base import Engine, EngineSnapshot, RunningInfo, StepResult
from pat_rollout.engine.ref.attention import build_metadata
from pat_rollout.engine.ref.config import RefEngineConfig, check_request, rope_parameters
from pat_rollout.engine.ref.kv_cache import KVCache
from pat_rollout.engine.ref.layers import frozen_param
from pat_rollout.engine.ref.loader import iter_safetensors, load_shards, load_tensors
from pat_rollout.engine.ref.model import CausalLM
from pat_rollout.engine.ref.sampler import sample
from pat_rollout.engine.ref.scheduler import Scheduler
from pat_rollout.engine.ref.sequence import Sequence
from pat_rollout.layout.shard import ShardSpec, kv_heads_for_rank, model_shard_specs
from pat_rollout.types import ModelSpec, Request, RequestOutput, RequestState

logger = logging.getLogger(__name__)
RELEASE_TAGS = ("weights", "kv_cache")


class RefEngine(Engine):
    """One TP rank of the reference engine. Every rank of a group must get the same calls in the
    same order; all ranks then schedule and sample identically (logits are all-gathered)."""

    def __init__(self, config: RefEngineConfig, tp: TPContext) -> None:
        self.config = config
        self._spec = config.model_spec()
        config.check_tp(self._spec, tp.size)
        self._specs = model_shard_specs(self._spec, config.max_tp)
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.tp = tp
        with torch.no_grad():
            self.model = CausalLM(self._spec, self._specs, tp, self.dtype, rope_parameters(config.hf_config()))
        load_tensors(self.named_shards(), self._specs, iter_safetensors(config.model_path), tp.rank, tp.size,
                     require_all=True)
        self.kv = KVCache(self._spec.num_layers, config.num_kv_blocks, config.block_size,
                          self._spec.num_local_kv_heads(tp.size), self._spec.head_dim, self.dtype)
        self.blocks = self.kv.blocks
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_prefill_tokens)
        self.exported: dict[str, Sequence] = {}
        # What the engine really did, for tests and metrics: prefill_tokens (every token a forward computed
        # that was not a decode step, recomputation included), imported, imported_with_kv,
        # kv_tokens_imported, import_fallbacks (KV given but recomputed for lack of blocks).
        self.stats: Counter[str] = Counter()

    # ---- introspection -------------------------------------------------------------------------
    @property
    def model_spec(self) -> ModelSpec:
        return self._spec

    @property
    def shard_specs(self) -> dict[str, ShardSpec]:
        return self._specs

    def named_shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameter tensors by shard-spec name (live storage: in-place edits apply)."""
        return {name: p.data for name, p in self.model.named_parameters()}

    def local_kv_heads(self) -> tuple[int, int]:
        """Half-open range [lo, hi) of global KV heads cached on this rank."""
        return kv_heads_for_rank(self._spec.num_kv_heads, self.tp.rank, self.tp.size)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def num_unfinished(self) -> int:
        """Running, waiting and exported requests (an idle engine has none)."""
        return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self.exported)

    def snapshot(self) -> EngineSnapshot:
        running = tuple(RunningInfo(request_id=s.request_id, num_prompt_tokens=s.num_prompt_tokens,
                                    num_output_tokens=s.num_output_tokens, max_new_tokens=s.sampling.max_new_tokens)
                        for s in self.scheduler.running)
        return EngineSnapshot(running=running, num_waiting=len(self.scheduler.waiting),
                              num_free_blocks=self.blocks.num_free, num_total_blocks=self.blocks.num_blocks,
                              block_size=self.blocks.block_size)

    # ---- generation ----------------------------------------------------------------------------
    def add_requests(self, requests: Iterable[Request]) -> None:
        """All-or-nothing: a request that can never run raises ValueError and none are queued."""
        requests = list(requests)
        self._check_new_ids([r.request_id for r in requests])
        for r in requests:
            check_request(r.request_id, r.prompt_token_ids, r.sampling.max_new_tokens, self._spec, self.config)
        self.scheduler.waiting.extend(Sequence(request_id=r.request_id, prompt_token_ids=tuple(r.prompt_token_ids),
                                               sampling=r.sampling, token_ids=list(r.prompt_token_ids))
                                      for r in requests)

    def step(self, num_steps: int = 1) -> StepResult:
        """Up to num_steps iterations; each is ONE forward over newly admitted prompts and every
        running sequence's next token. extra["num_preempted"] counts recompute preemptions."""
        start = time.perf_counter()
        finished: list[RequestOutput] = []
        done = num_prefill = num_decode = num_preempted = 0
        if self.kv.pool is None and self.has_unfinished():
            raise RuntimeError("step: the KV cache is released; call resume(['kv_cache']) first")
        with torch.inference_mode():
            while done < num_steps and self.has_unfinished():
                batch = self.scheduler.schedule()
                if not batch.seqs:
                    self._raise_stuck()
                finished += self._run(batch.seqs)
                done += 1
                num_prefill += batch.num_prefill_tokens
                num_decode += batch.num_decode_tokens
                num_preempted += batch.num_preempted
        self.stats["prefill_tokens"] += num_prefill
        return StepResult(finished=tuple(finished), num_steps=done, num_decode_tokens=num_decode,
                          num_prefill_tokens=num_prefill, num_running=len(self.scheduler.running),
                          num_waiting=len(self.scheduler.waiting), elapsed_s=time.perf_counter() - start,
                          extra={"num_preempted": num_preempted})

    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """Convenience for tests and benchmarks: run `requests` to completion on an idle engine."""
        requests = list(requests)
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; use add_requests/step instead")
        self.add_requests(requests)
        outputs: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            outputs.update((o.request_id, o) for o in self.step(16).finished)
        return [outputs[r.request_id] for r in requests]

    def _run(self, seqs: tuple[Sequence, ...]) -> list[RequestOutput]:
        assert self.kv.pool is not None
        md = build_metadata([s.num_cached for s in seqs], [s.num_tokens for s in seqs],
                            [s.block_table for s in seqs], self.blocks.block_size,
                            self.model.rotary.cos, self.model.rotary.sin)
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids[s.num_cached:]])
        logits = self.model(input_ids, md, self.kv.pool)
        tokens, log_probs = sample(logits, [s.sampling for s in seqs], [s.num_output_tokens for s in seqs])
        finished = []
        for seq, token, log_prob in zip(seqs, tokens, log_probs):
            seq.num_cached = seq.num_tokens
            seq.token_ids.append(token)
            seq.output_log_probs.append(log_prob)
            reason = seq.finish_reason(self._spec.eos_token_ids)
            if reason is not None:
                self.scheduler.finish(seq)
                finished.append(seq.to_output(reason))
        return finished

    def abort_all(self) -> list[RequestOutput]:
        """Abort running and waiting requests (exported ones belong to their importer)."""
        seqs = self.scheduler.remove(None)
        for seq in seqs:
            self.blocks.free(seq)
        return [s.to_output("abort") for s in seqs]

    # ---- reconfiguration hooks -----------------------------------------------------------------
    def export_requests(self, request_ids: Iterable[str] | None = None) -> list[RequestState]:
        wanted = None if request_ids is None else set(request_ids)
        live = {s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting)}
        if wanted is not None and (missing := sorted(wanted - live)):
            raise ValueError(f"export_requests: request ids {missing} are not running or waiting")
        seqs = self.scheduler.remove(wanted)
        self.exported.update((s.request_id, s) for s in seqs)
        return [s.to_state() for s in seqs]

    def export_kv(self, request_id: str, kv_heads: tuple[int, int]) -> torch.Tensor:
        seq = self.exported.get(request_id)
        if seq is None:
            raise ValueError(f"export_kv: request {request_id!r} is not exported (exported: {sorted(self.exported)})")
        (lo, hi), (own_lo, own_hi) = kv_heads, self.local_kv_heads()
        if not own_lo <= lo < hi <= own_hi:
            raise ValueError(f"export_kv: tp_rank={self.tp.rank} of tp_size={self.tp.size} holds KV heads "
                             f"[{own_lo}, {own_hi}), not [{lo}, {hi})")
        return self.kv.read(seq, seq.num_cached, (lo - own_lo, hi - own_lo))

    def free_exported(self) -> None:
        for seq in self.exported.values():
            self.blocks.free(seq)
        self.exported.clear()

    def import_requests(self, states: Iterable[RequestState], kv: dict[str, torch.Tensor] | None = None) -> list[str]:
        """Requests with KV resume decoding at the next step, even past max_num_seqs (one whose blocks
        do not fit is recomputed, with a warning); the others are queued ahead of new requests and
        recompute their cached prefix. Validation is all-or-nothing. Returns the ids given KV that were
        recomputed for lack of blocks (also counted in `stats`)."""
        states, kv = list(states), kv or {}
        self._check_new_ids([s.request_id for s in states])
        if unknown := sorted(set(kv) - {s.request_id for s in states}):
            raise ValueError(f"import_requests: kv given for requests not being imported: {unknown}")
        local_kv = self._spec.num_local_kv_heads(self.tp.size)
        for st in states:
            check_request(st.request_id, st.prompt_token_ids, st.sampling.max_new_tokens, self._spec, self.config)
            if not 0 <= st.num_cached_tokens < st.num_tokens or st.remaining_budget < 1:
                raise ValueError(f"import_requests: {st.request_id!r} has num_cached_tokens={st.num_cached_tokens}, "
                                 f"num_tokens={st.num_tokens}, remaining_budget={st.remaining_budget}")
            expected = (self._spec.num_layers, 2, st.num_cached_tokens, local_kv, self._spec.head_dim)
            if st.request_id in kv and tuple(kv[st.request_id].shape) != expected:
                raise ValueError(f"import_requests: kv[{st.request_id!r}] has shape {tuple(kv[st.request_id].shape)}, "
                                 f"expected {expected} (tp_rank={self.tp.rank}, tp_size={self.tp.size})")
        recompute, fallbacks = [], []
        for st in states:
            seq = Sequence.from_state(st)
            cache = kv.get(st.request_id)
            if cache is None or st.num_cached_tokens == 0:
                recompute.append(seq)
                continue
            if self.blocks.num_missing(seq, st.num_cached_tokens) > self.blocks.num_free:
                logger.warning("import_requests: no KV blocks for %r (%d free); recomputing its %d cached tokens",
                               st.request_id, self.blocks.num_free, st.num_cached_tokens)
                recompute.append(seq)
                fallbacks.append(st.request_id)
                continue
            self.blocks.allocate(seq, st.num_cached_tokens)
            self.kv.write(seq, cache)
            seq.num_cached = st.num_cached_tokens
            self.scheduler.running.append(seq)
            self.stats["imported_with_kv"] += 1
            self.stats["kv_tokens_imported"] += st.num_cached_tokens
        self.scheduler.waiting.extendleft(reversed(recompute))
        self.stats["imported"] += len(states)
        self.stats["import_fallbacks"] += len(fallbacks)
        return fallbacks

    def set_layout(self, tp: TPContext, shards: dict[str, torch.Tensor] | None = None) -> None:
        """Rebind to TP group `tp`, swapping in `shards` (this rank's tensors in the new layout) and
        reallocating the KV pool. shards=None keeps the current tensors when their shapes fit the
        new layout, and otherwise reloads this rank's shards from config.model_path (warning: any
        update_weights since load are lost)."""
        counts = (len(self.scheduler.running), len(self.scheduler.waiting), len(self.exported))
        if any(counts):
            raise RuntimeError(f"set_layout needs an idle engine: running={counts[0]} waiting={counts[1]} "
                               f"exported={counts[2]} (export_requests + free_exported first)")
        self.config.check_tp(self._spec, tp.size)
        if shards is None:
            shards = self.named_shards()
            if any(tuple(t.shape) != self._specs[n].local_shape(tp.rank, tp.size) for n, t in shards.items()):
                logger.warning("set_layout(tp_size=%d, shards=None): reloading shards from %s",
                               tp.size, self.config.model_path)
                shards = load_shards(self.config.model_path, self._specs, tp.rank, tp.size, self.dtype)
        if sorted(shards) != sorted(self._specs):
            missing, unexpected = sorted(set(self._specs) - set(shards)), sorted(set(shards) - set(self._specs))
            raise ValueError(f"set_layout: shard names differ from the specs: missing {missing}, "
                             f"unexpected {unexpected}")
        for name, t in shards.items():
            expected = self._specs[name].local_shape(tp.rank, tp.size)
            if tuple(t.shape) != expected or t.dtype != self.dtype:
                raise ValueError(f"set_layout: {name} is {tuple(t.shape)} {t.dtype}, expected {expected} {self.dtype} "
                                 f"for tp_rank={tp.rank} tp_size={tp.size}")
        for name, t in shards.items():
            module_name, attr = name.rsplit(".", 1)
            setattr(self.model.get_submodule(module_name), attr, frozen_param(t))
        self.tp = tp
        self.model.bind(tp)
        self.kv.set_num_kv_heads(self._spec.num_local_kv_heads(tp.size))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_tensors(self.named_shards(), self._specs, named_tensors, self.tp.rank, self.tp.size, require_all=False)

    def reload_weights(self, model_path: str | None = None) -> None:
        """Overwrite this rank's shards from a checkpoint folder (default: config.model_path)."""
        load_tensors(self.named_shards(), self._specs, iter_safetensors(model_path or self.config.model_path),
                     self.tp.rank, self.tp.size, require_all=True)

    def release(self, tags: Iterable[str] = RELEASE_TAGS) -> None:
        """Tag "kv_cache" drops the KV pool (engine must be idle). Tag "weights" is a no-op on CPU:
        trainer and engine share host memory, and update_weights overwrites the shards in place."""
        tags = self._check_tags(tags)
        if "kv_cache" in tags:
            if self.has_unfinished() or self.exported:
                raise RuntimeError(f"release(kv_cache) with running={len(self.scheduler.running)} "
                                   f"waiting={len(self.scheduler.waiting)} exported={len(self.exported)}")
            self.kv.release()

    def resume(self, tags: Iterable[str] = RELEASE_TAGS) -> None:
        if "kv_cache" in self._check_tags(tags) and self.kv.pool is None:
            self.kv.allocate()

    # ---- helpers -------------------------------------------------------------------------------
    def _check_new_ids(self, ids: list[str]) -> None:
        live = {s.request_id for s in (*self.scheduler.running, *self.scheduler.waiting, *self.exported.values())}
        if dup := sorted({i for i, n in Counter(ids).items() if i in live or n > 1}):
            raise ValueError(f"request ids already in the engine or repeated: {dup}")

    def _check_tags(self, tags: Iterable[str]) -> set[str]:
        tags = set(tags)
        if bad := sorted(tags - set(RELEASE_TAGS)):
            raise ValueError(f"unknown release/resume tags {bad}; expected a subset of {RELEASE_TAGS}")
        return tags

    def _raise_stuck(self) -> None:
        seq = self.scheduler.waiting[0]
        raise RuntimeError(
            f"no request can run: {seq.request_id!r} needs {self.blocks.num_missing(seq, seq.num_tokens)} KV blocks, "
            f"{self.blocks.num_free} free, {sum(len(s.block_table) for s in self.exported.values())} held by exported "
            f"requests (call free_exported()), kv pool {'released' if self.kv.pool is None else 'allocated'}")
