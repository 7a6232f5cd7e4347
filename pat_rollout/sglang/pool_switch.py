"""Scheduler-process side of an `SglPool` layout switch: `Scheduler.pat_*` methods reached by `collective_rpc`.

The driver first aborts every unfinished request through SGLang's own API and keeps the tokens and log-probs
the aborts return. SGLang checkpoints a finished (here: aborted) request's KV into its radix tree, so each
rank's tree still holds the KV of the requests its replica ran. `pat_switch` then, on every rank at once:

0. drain: with overlap scheduling the last batch's result may still be queued; process it as SGLang's own
   pause does (`_drain`);
1. export: for each request chosen for migration, the longest prefix of its tokens cached in the old replica's
   trees (the same on every rank of the replica; the minimum is taken to be safe), at most all tokens but the
   last (the resubmission prefills at least that one);
2. KV hand-off: pat_rollout's `plan_kv` + `gather_kv` over the WORLD's device group: each new rank receives the
   KV heads it needs (`kv_heads_for_rank`) for the tokens its new replica will continue;
3. flush SGLang's radix tree and KV pool (the exported pieces are copies by now);
4. reshard the live parameters with `plan_weights` + `reshard_local(keep_storage=True)` (grow: in place, zero
   bytes moved; shrink: receives over the same group, copied back into the parameter's own storage), so every
   parameter keeps its object and address in every layout; use the module tree built for the new layout the first
   time the pool entered it (or build it, `_rebuild`): what CUDA graphs captured per layout would need;
5. view the same KV storage for the new head count and set SGLang's token limits (`kv_room`: a TPk replica
   holds k times a TP1 replica's tokens), then insert every received prefix into the radix tree;
6. reseed every RNG SGLang's sampler draws from, the same on every rank of a replica (`_reseed`).

The driver then resubmits every request (prompt + generated tokens, remaining budget) to its new replica: SGLang's
own prefix matching finds the migrated KV, so only the tokens after the cached prefix are prefilled; requests
chosen for recomputation are prefilled in full. Results come back as JSON files (`collective_rpc` returns none).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from typing import Any

import torch

from pat_rollout.kv.apply import gather_kv
from pat_rollout.kv.plan import plan_kv
from pat_rollout.layout.layout import Layout
from pat_rollout.layout.shard import kv_heads_for_rank
from pat_rollout.layout.transition import plan_weights
from pat_rollout.reshard.apply import copy_into_storage, reshard_local
from pat_rollout.sglang import compat, kv_room, layout_graphs, pool_hooks, rank_rpc, replica_input
from pat_rollout.sglang.live_model import _hf_config_dict, rebuild_model_for_current_tp, sglang_specs
from pat_rollout.types import ModelSpec


def _world():
    from sglang.srt.distributed.parallel_state import get_world_group

    return get_world_group()


def _transport(timeout: list[float], device: torch.device):
    """The transport for tensors on `device` (`comm.transport.transport_for`): a GlooTransport over pat_rollout's
    own gloo group of all ranks for CPU tensors, pinned-host staging over it for device tensors (no CUDA tensor
    ever reaches gloo: the GlooTransport checks it). The group is created on first use (every rank runs
    pat_switch, so every rank creates it together) and dropped by every rollback: a failed rank aborts it
    (`GlooTransport.abort` closes its pairs so a blocked peer fails at once), which leaves it unusable, and
    SGLang's own groups must never be the ones closed. Each `run()` waits at most floor + bytes / rate."""
    import torch.distributed as dist

    from pat_rollout.comm.transport import GlooTransport, TransferTimeout, transport_for

    st = pool_hooks.STATE
    if st.transport_group is None:
        st.transport_group = dist.new_group(list(range(st.world)), backend="gloo")
    floor_s, rate, max_s = timeout
    gloo = GlooTransport(group=st.transport_group, device_to_group_rank={r: r for r in range(st.world)},
                         timeout=TransferTimeout(floor_s=floor_s, min_bytes_per_s=rate, max_s=max_s))
    return transport_for(device, gloo)


ALLOC_SPY_ENV = "PAT_SGLANG_ALLOC_SPY"  # "1": pat_switch reports the peak extra bytes of its KV and reshard phases


def _alloc_spy():
    """An `AllocSpy` when ALLOC_SPY_ENV is "1" (tests, benches: it intercepts every torch op), else None."""
    import os

    if os.environ.get(ALLOC_SPY_ENV) != "1":
        return None
    from pat_rollout.comm.alloc_spy import AllocSpy

    return AllocSpy()


def _maybe_fail(phase: str) -> None:
    """Test hook (`pat_fail_next`): raise, or hang `hang_s` and then raise, on the armed rank (or every rank)."""
    rank_rpc.enter(phase)
    st = pool_hooks.STATE
    if st.fail_next is None or st.fail_next[0] != phase or st.fail_next[1] not in (None, st.rank):
        return
    hang_s = st.fail_next[2]
    st.fail_next = None
    if hang_s:
        time.sleep(hang_s)
    raise RuntimeError(f"injected failure in SglPool switch phase {phase!r} on rank {st.rank}")


def _drain(self) -> list[str]:
    """Leave no batch in flight; returns the rids of unfinished requests the last batch held.

    With overlap scheduling SGLang's event loop launches batch N+1 before it processes batch N's result, so an
    RPC (read at the top of an iteration) finds the last batch's result still queued: process it now, as
    SGLang's own `pause_generation` does, so that no result of the old layout's batch lands after the switch
    (on a flushed pool, through rebuilt modules). Then forget the batch: the loop's next iteration must not
    process it again, and a prefill batch's requests are merged into the running batch only from it."""
    last = self.last_batch
    if last is None:
        return []
    if self.enable_overlap:
        batch, result = self.result_queue.popleft()
        self.process_batch_result(batch, result)
    self.last_batch = None
    return [r.rid for r in last.reqs if not r.finished()]


def _check_idle(self) -> None:
    """No unfinished request may be left. Aborted requests whose final output was already sent can still sit
    in the running batch until the next scheduling step filters them: drop them here (their KV is released)."""
    busy = _drain(self)
    reqs = self.running_batch.reqs if self.running_batch is not None else []
    busy += [r.rid for r in reqs if not r.finished()]
    if busy or self.waiting_queue or self.chunked_req is not None:
        raise RuntimeError(f"rank {pool_hooks.STATE.rank}: switch needs an idle scheduler, found running {busy} and "
                           f"{len(self.waiting_queue)} waiting requests (the driver aborts them first)")
    if reqs:
        self.running_batch.filter_batch()


def _flush(self) -> None:
    compat.reset_admission_state(self)  # the ranks of a new replica must admit alike
    self.last_batch = None
    self.cur_batch_for_debug = None
    self.tree_cache.reset()
    self.req_to_token_pool.clear()
    self.token_to_kv_pool_allocator.clear()


def _kv_pool(self):
    pool = self.tp_worker.model_runner.token_to_kv_pool
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd" or getattr(pool, "use_hnd", False):
        raise NotImplementedError(f"SglPool moves KV of the NHD pool layout only, got {pool.kv_cache_layout!r}")
    return pool


def _insert_prefix(self, pool, tokens: list[int], kv: torch.Tensor, chunk_bytes: int) -> None:
    """Put `kv` ([L, 2, T, h, D], this rank's heads, on the host) for `tokens[:T]` into fresh slots and the radix
    tree, copied in pieces of at most `chunk_bytes` per layer straight into the slots."""
    n = kv.shape[2]
    slots = self.token_to_kv_pool_allocator.alloc(n)
    if slots is None:
        raise RuntimeError(f"KV pool has no room for {n} migrated tokens")
    if len(slots) != n:  # a paged allocator rounds to whole pages; check_model refuses page_size > 1
        raise RuntimeError(f"KV allocator returned {len(slots)} slots for {n} migrated tokens (page_size > 1?)")
    per_token = kv[0, 0, 0].numel() * kv.element_size() if n else 1
    step = max(1, chunk_bytes // max(1, per_token))
    for layer in range(kv.shape[0]):
        for t0 in range(0, n, step):
            part = slots[t0 : t0 + step]
            pool.k_buffer[layer][part] = kv[layer, 0, t0 : t0 + step].to(pool.k_buffer[layer].device,
                                                                         pool.k_buffer[layer].dtype)
            pool.v_buffer[layer][part] = kv[layer, 1, t0 : t0 + step].to(pool.v_buffer[layer].device,
                                                                         pool.v_buffer[layer].dtype)
    prefix_len = compat.insert_prefix(self.tree_cache, tokens[:n], slots)
    if prefix_len:  # a shared prefix was already there: its slots stay, ours for that part are spare
        self.token_to_kv_pool_allocator.free(slots[:prefix_len])


def _replica_seed(random_seed: int, switches: int, replica: int) -> int:
    """Sampler seed of one replica after the `switches`-th switch: equal on its ranks, different across replicas
    and switches. < 2**32 because SGLang's `set_random_seed` also seeds numpy."""
    digest = hashlib.blake2b(f"{random_seed}:{switches}:{replica}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _reseed(self) -> float:
    """Give every rank of this rank's new replica the same RNG state; returns the seconds it took.

    SGLang does not exchange sampled token ids between the ranks of a TP group (only with
    SYNC_TOKEN_IDS_ACROSS_TP or grammars, `Sampler._sync_token_ids_across_tp`): each rank samples on its own
    (`torch.multinomial`, the Gumbel `exponential_`, flashinfer's kernels: all on the torch default generator
    of the device) and relies on identical RNG states, which SGLang seeds once from `random_seed` at start-up.
    In a layout with several replicas the ranks run different batches and their states diverge, so the ranks
    of a new wider replica would sample different tokens, feed different embeddings into the same
    all-reduces and, when one reaches EOS first, leave the other blocked in a collective. SGLang's own
    `set_random_seed` seeds python, numpy, torch CPU and every CUDA device: the same RNGs it seeded at start."""
    from sglang.srt.utils import set_random_seed

    st = pool_hooks.STATE
    t = time.perf_counter()
    set_random_seed(_replica_seed(int(self.server_args.random_seed), st.switches, st.replica))
    return time.perf_counter() - t


def _rebuild(self, params: dict[str, torch.Tensor] | None, tp: int) -> None:
    """The module tree for TP `tp`: the one built the first time the pool entered it, when it still holds the very
    parameter objects of the live model (switches keep them: `keep_storage`), else a new one (then kept). The same
    modules, parameters and buffers at the same addresses each time: what a CUDA graph captured per layout needs."""
    runner = self.tp_worker.model_runner
    st = pool_hooks.STATE
    live = dict(runner.model.named_parameters())
    live.update(params or {})
    cached = st.models.get(tp)
    if cached is not None and all(p is live.get(n) for n, p in cached.named_parameters()):
        runner.model = cached
        return
    with pool_hooks.tp_context(tp):
        runner.model = rebuild_model_for_current_tp(runner.model, params)
    st.models[tp] = runner.model


def pat_switch(self, dst_groups: list[list[int]], moves: list[list[Any]], path: str,
               transfer_timeout: list[float], chunk_bytes: int = 64 << 20) -> None:
    """Switch this rank to layout `dst_groups`. `moves`: [request_id, tokens, src_replica, dst_replica] of every
    request chosen for KV migration (tokens = prompt + generated so far). `transfer_timeout`: [floor_s,
    min_bytes_per_s, max_s] of every transfer (`TransferTimeout`); `chunk_bytes`: the bound on one transfer round
    (PatRolloutConfig.transfer_chunk_bytes). An exception leaves with `pat_phase` naming
    the phase; a failure in a transfer phase aborts the transport first, so no peer stays blocked on it."""
    st = pool_hooks.STATE
    st.switches += 1  # first, before any failure point: every rank counts every switch and rollback
    src_groups = st.groups
    transport = _transport(transfer_timeout, next(self.tp_worker.model_runner.model.parameters()).device)
    state = {"phase": "export"}
    error: BaseException | None = None
    try:
        _switch(self, state, transport, dst_groups, moves, path, chunk_bytes)
    except BaseException as e:
        if state["phase"] in ("kv", "reshard"):
            transport.abort()
        layout_graphs.on_switch_failure(self, state["phase"], len(dst_groups[0]))  # --- abort (#35)
        with contextlib.suppress(AttributeError):
            e.pat_phase = state["phase"]
        error = e
    _route_by_agreed_layout(error is None, src_groups)
    if error is not None:
        raise error


def _route_by_agreed_layout(ok: bool, src_groups: tuple[tuple[int, ...], ...]) -> None:
    """A switch changes who leads a replica, and rank 0 routes each request by its own view of the layout
    (`replica_input`). If the switch failed on any rank (in a phase without a collective, the others finished it),
    every rank goes back to the old layout's groups, so the driver's rollback RPC reaches every leader alike;
    `pat_restore_base` then rebuilds the base layout on every rank. One all-gather over the WORLD's CPU group."""
    st = pool_hooks.STATE
    rank_rpc.enter(rank_rpc.AGREE_PHASE)
    every: list[Any] = [None] * st.world
    torch.distributed.all_gather_object(every, ok, group=_world().cpu_group)
    if not all(every):
        st.groups = src_groups


def _agree(error: Exception | None, what: str, payload: Any) -> list[Any]:
    """all_gather_object of every rank's payload, or its error, over the WORLD's CPU group; if any rank failed,
    every rank raises (the failed one its own error), so no rank is left waiting in a later collective for one
    that left. Returns the payloads in rank order."""
    st = pool_hooks.STATE
    got: list[Any] = [None] * st.world
    mine = (True, payload) if error is None else (False, f"{type(error).__name__}: {error}")
    torch.distributed.all_gather_object(got, mine, group=_world().cpu_group)
    if error is not None:
        raise error
    if bad := [r for r, (good, _) in enumerate(got) if not good]:
        raise RuntimeError(f"rank {st.rank}: {what} failed on rank(s) {bad}: {[got[r][1] for r in bad]}")
    return [p for _, p in got]


def _switch(self, state: dict[str, str], transport, dst_groups: list[list[int]], moves: list[list[Any]],
            path: str, chunk_bytes: int) -> None:
    st = pool_hooks.STATE
    src, dst = Layout(st.groups), Layout(tuple(tuple(g) for g in dst_groups))
    rank, runner = st.rank, self.tp_worker.model_runner
    st.models.setdefault(src.tp_size, runner.model)  # the first time: the model SGLang built, kept for the way back
    layout_graphs.remember(self, src.tp_size)  # and its attention backends and graphs
    hf = _hf_config_dict(self)
    num_kv_heads = ModelSpec.from_hf_config(hf).num_kv_heads
    pool = _kv_pool(self)
    phase: dict[str, float] = {}
    t = time.perf_counter()
    # 1. what the old replica holds of each migrated request; a rank failing here tells the others
    src_groups = {m[0]: src.groups[m[2]] for m in moves}
    held: dict[str, torch.Tensor] = {}
    error = None
    try:
        _check_idle(self)
        _maybe_fail("export")
        held = {m[0]: compat.prefix_indices(self.tree_cache, m[1]) for m in moves if rank in src_groups[m[0]]}
    except Exception as e:
        error = e
    lens = _agree(error, "export", {rid: len(ix) for rid, ix in held.items()})
    # All but the last token at most: SGLang prefills at least one token of a resubmission, so a longer prefix
    # would not be found whole (with overlap scheduling the tree can already hold the last token's KV).
    cached = {m[0]: min([len(m[1]) - 1] + [lens[r][m[0]] for r in src_groups[m[0]]]) for m in moves}
    kv_moves = [(m[0], src.groups[m[2]], dst.groups[m[3]], cached[m[0]]) for m in moves if cached[m[0]] > 0]
    plan = plan_kv(kv_moves, num_kv_heads)
    old_lo = kv_heads_for_rank(num_kv_heads, src.position(rank)[1], src.tp_size)[0]
    phase["export"] = time.perf_counter() - t

    # 2. KV hand-off
    t = time.perf_counter()
    state["phase"] = "kv"
    _maybe_fail("kv")

    def export_fn(rid: str, heads: tuple[int, int], tokens: tuple[int, int]) -> torch.Tensor:
        ix = held[rid][tokens[0] : min(tokens[1], cached[rid])]
        lo, hi = heads[0] - old_lo, heads[1] - old_lo
        out = torch.empty((len(pool.k_buffer), 2, len(ix), hi - lo, pool.head_dim), dtype=pool.k_buffer[0].dtype,
                          device=pool.k_buffer[0].device)
        for layer in range(len(pool.k_buffer)):  # one piece (<= a chunk), gathered straight into its place
            out[layer, 0] = pool.k_buffer[layer][ix, lo:hi]
            out[layer, 1] = pool.v_buffer[layer][ix, lo:hi]
        return out

    # Received KV waits in host memory (pinned on CUDA) until the import: the KV storage is re-viewed for the new
    # layout in between, so it cannot land in its final slots before; at most kv_handoff_cap bytes (the driver's
    # migrate-or-recompute choice), exchanged in rounds of at most chunk_bytes (device scratch: about two chunks).
    on_cuda = pool.k_buffer[0].device.type == "cuda"
    tokens = {m[0]: m[1] for m in moves}
    with contextlib.ExitStack() as stack:
        kv_spy = _alloc_spy()  # the hand-off's extra bytes: from the exchange to the import, nothing else in between
        if kv_spy is not None:
            stack.enter_context(kv_spy)
        incoming = gather_kv(plan, rank, export_fn, transport, num_layers=len(pool.k_buffer),
                             head_dim=pool.head_dim, dtype=pool.k_buffer[0].dtype, device="cpu", pin_memory=on_cuda,
                             chunk_bytes=chunk_bytes)
        phase["kv_handoff"] = time.perf_counter() - t
        with kv_spy.paused() if kv_spy is not None else contextlib.nullcontext():
            reshard_peak = _reshard_and_rebuild(self, state, transport, src, dst, hf, chunk_bytes, phase)
            kv_room_tokens = _enter_layout(self, dst, num_kv_heads, phase)
        t = time.perf_counter()
        state["phase"] = "import"
        _maybe_fail("import")
        no_room = []
        for rid in [r for r in tokens if r in incoming]:  # the driver's order: the same on every rank of a replica
            kv = incoming.pop(rid)  # host memory freed as it goes
            if kv_room.reclaiming() and kv.shape[2] > self.token_to_kv_pool_allocator.available_size():
                # a shrink gave back the room this KV needed: not inserted, so the resubmission recomputes it
                # (it waits in SGLang's queue until the room frees)
                no_room.append(rid)
                continue
            _insert_prefix(self, pool, tokens[rid], kv, chunk_bytes)
    phase["reseed"] = _reseed(self)
    phase["switch"] += time.perf_counter() - t
    peaks = {} if kv_spy is None else dict(kv_peak_bytes=kv_spy.peak, reshard_peak_bytes=reshard_peak)
    _write(path, rank, dict(phase_s=phase, cached_tokens=cached, params_in_place=phase.pop("_in_place"),
                            params_total=phase.pop("_total"),
                            bytes_moved=sum(t.num_heads * t.num_tokens for t in plan.transfers if not t.is_local
                                            and t.dst_device == rank) * len(pool.k_buffer) * 2 * pool.head_dim
                            * pool.k_buffer[0].element_size(),
                            layout=[list(g) for g in st.groups], kv_heads=int(pool.head_num), kv_tokens=kv_room_tokens,
                            no_room=no_room, reclaim=kv_room.reclaim_info(self), **peaks))


def _reshard_and_rebuild(self, state: dict[str, str], transport, src: Layout, dst: Layout, hf: dict,
                         chunk_bytes: int, phase: dict) -> int | None:
    """Phases 3-4: flush, reshard in place, rebuild the modules for the new layout. Returns the reshard's peak extra
    bytes when ALLOC_SPY_ENV is set."""
    st = pool_hooks.STATE
    rank, runner = st.rank, self.tp_worker.model_runner

    # 3-4. flush, reshard in place, rebuild the modules for the new layout
    t = time.perf_counter()
    state["phase"] = "reshard"
    _flush(self)
    _maybe_fail("reshard")
    kv_room.before_weights(self, dst.tp_size)  # reclaim_weight_memory: a shrink's pages come home first
    old = runner.model
    specs = sglang_specs(hf, int(old.model.embed_tokens.num_embeddings_padded))
    named = dict(old.named_parameters())
    specs = {n: s for n, s in specs.items() if n in named}
    wplan = plan_weights(src, dst, specs)
    sharded = {n: named[n] for n in specs if specs[n].dim is not None}
    # In place (keep_storage): a grow compacts, a shrink expands inside each parameter's own storage (allocated in
    # the weights region at start-up) and receives straight into place; what is allocated here is transfer scratch
    # of at most one chunk per round (and, for a step that is neither, one parameter's new shard at a time, copied
    # back and freed), outside the memory saver's weights region so none of it stays cached there.
    spy = _alloc_spy()
    with torch.no_grad(), spy if spy is not None else contextlib.nullcontext():
        new_params = reshard_local(sharded, wplan, rank, transport, keep_storage=True, chunk_bytes=chunk_bytes)
    phase["_in_place"] = sum(1 for n in sharded if new_params[n] is named[n])  # keep_storage: all (same objects)
    phase["_total"] = len(sharded)
    phase["reshard"] = time.perf_counter() - t

    t = time.perf_counter()
    state["phase"] = "switch"
    _maybe_fail("switch")
    st.groups = dst.groups
    with compat.weights_region(self.server_args, runner):
        _rebuild(self, new_params, dst.tp_size)
    phase["switch"] = time.perf_counter() - t
    return None if spy is None else spy.peak


def _enter_layout(self, dst: Layout, num_kv_heads: int, phase: dict) -> int:
    """Phase 5's first half: view the KV storage for the new layout and enter its graphs; returns its KV tokens."""
    t = time.perf_counter()
    lo, hi = kv_heads_for_rank(num_kv_heads, dst.position(pool_hooks.STATE.rank)[1], dst.tp_size)
    kv_tokens = kv_room.set_layout(self, num_kv_heads=num_kv_heads, tp=dst.tp_size, head_num=hi - lo)
    phase["capture"] = layout_graphs.enter(self, dst.tp_size)  # 0 unless the layout's graphs are captured now
    phase["switch"] += time.perf_counter() - t - phase["capture"]  # the capture is its own phase
    return kv_tokens


def pat_restore_base(self, path: str) -> None:
    """Rollback after a failed switch: base-layout weights from the host backup, base KV pool, empty cache."""
    st = pool_hooks.STATE
    st.switches += 1
    st.transport_group = None  # a failed switch may have closed it: the next switch creates a fresh one
    rank_rpc.enter("rollback")
    _maybe_fail("rollback")
    runner = self.tp_worker.model_runner
    _drain(self)  # nothing of the failed layout's batches may land later; what was running is resubmitted
    _flush(self)
    base = Layout(st.base)
    kv_room.before_weights(self, base.tp_size)  # reclaim_weight_memory: every lent page home before the copy
    with compat.weights_region(self.server_args, runner):  # what release frees (see pat_switch)
        # Into the live parameters' own storages (switches keep every storage whole: `keep_storage`), so the base
        # layout's parameters are back at the addresses they were loaded at.
        live = dict(runner.model.named_parameters())
        params = {n: copy_into_storage(live[n], t, n) for n, t in st.backup.items()}
        st.groups = base.groups
        _rebuild(self, params, base.tp_size)
    num_kv_heads = ModelSpec.from_hf_config(_hf_config_dict(self)).num_kv_heads
    lo, hi = kv_heads_for_rank(num_kv_heads, base.position(st.rank)[1], base.tp_size)
    kv_tokens = kv_room.set_layout(self, num_kv_heads=num_kv_heads, tp=base.tp_size, head_num=hi - lo)
    layout_graphs.enter(self, base.tp_size)
    reseed_s = _reseed(self)  # a base replica of several ranks may have diverged in the layout left behind
    _write(path, st.rank, dict(layout=[list(g) for g in st.groups], reseed_s=reseed_s, kv_tokens=kv_tokens))


def pat_backup_base(self) -> None:
    """Host copy of this rank's base-layout parameters: what a rollback restores. Taken once at start-up and once per
    weight sync (SglPool.end_weight_update: after its last bucket, not per bucket). Pinned host memory on CUDA; a
    later backup copies into the same host tensors, so host memory stays one copy of the rank's parameters."""
    st = pool_hooks.STATE
    if Layout(st.groups) != Layout(st.base):
        raise RuntimeError(f"rank {st.rank}: backup outside the base layout ({st.groups} != {st.base})")
    params = dict(self.tp_worker.model_runner.model.named_parameters())
    old = st.backup or {}
    if old.keys() != params.keys() or any(old[n].shape != p.shape or old[n].dtype != p.dtype
                                          for n, p in params.items()):
        st.backup = None  # free the stale copy first
        pin = torch.cuda.is_available() and any(p.is_cuda for p in params.values())
        old = {n: torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            old[n].copy_(p.detach())
    st.backup = old
    st.backups += 1


def pat_reclaim_start(self, path: str) -> None:
    """reclaim_weight_memory: report what SGLang's start-up did (`kv_room.install_startup_hooks` adopted this rank's
    weight and KV storages into the mapper's ranges, before the KV pool's allocation and the graph capture
    respectively), with the start-up event sequence; a RuntimeError when it did not run."""
    kv_room.started(self)
    _write(path, pool_hooks.STATE.rank, dict(reclaim=kv_room.reclaim_info(self)))


def pat_fail_next(self, phase: str | None, rank: int | None = None, hang_s: float = 0.0) -> None:
    """Test hook: the next `phase` (rank_rpc.FAULT_PHASES, or "rollback") on `rank` (None: every rank) raises,
    after hanging `hang_s` seconds if given."""
    if phase is not None and phase not in (*rank_rpc.FAULT_PHASES, "rollback"):
        raise ValueError(f"pat_fail_next: phase={phase!r} is not one of {rank_rpc.FAULT_PHASES + ('rollback',)}")
    pool_hooks.STATE.fail_next = None if phase is None else (phase, rank, float(hang_s))


def pat_pool_info(self, path: str) -> None:
    """This rank's layout, KV room and addresses, parameters and queues (tests and SglPool read it)."""
    import os

    st = pool_hooks.STATE
    pool = self.tp_worker.model_runner.token_to_kv_pool
    model = self.tp_worker.model_runner.model
    params = dict(model.named_parameters())
    running = len(self.running_batch.reqs) if self.running_batch is not None else 0
    _write(path, st.rank, dict(
        rank=st.rank, pid=os.getpid(), layout=[list(g) for g in st.groups], replica=st.replica, leader=st.is_leader,
        per_replica_input=st.per_replica_input, group_ids={str(tp): id(c) for tp, c in st.coordinators.items()},
        kv_heads=int(pool.head_num), kv_tokens=int(pool.size), kv_storage=kv_room.storage_ptrs(pool),
        kv_limits=kv_room.limits(self),
        params={n: list(p.shape) for n, p in params.items()}, param_ptrs={n: p.data_ptr() for n, p in params.items()},
        model_id=id(model), num_running=running, backups=st.backups, num_waiting=len(self.waiting_queue),
        admission=compat.admission_state(self), attention_id=id(self.tp_worker.model_runner.attn_backend),
        graphs=dict(on=layout_graphs.enabled(self), current=layout_graphs.describe(compat.graph_runner(
            self.tp_worker.model_runner)), layouts=sorted(st.graphs)), reclaim=kv_room.reclaim_info(self),
        idle=dict(replica_input.IDLE_STATS)))


def _write(path: str, rank: int, obj: dict) -> None:
    with open(f"{path}.rank{rank}.json", "w") as f:
        json.dump(obj, f)


RPC_METHODS = {f.__name__: f for f in (pat_switch, pat_restore_base, pat_backup_base, pat_fail_next, pat_pool_info,
                                        pat_reclaim_start)}
