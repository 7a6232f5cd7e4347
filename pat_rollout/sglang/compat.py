"""Every SGLang version difference the backend touches, in one place: 0.5.23 (CI) and 0.5.12 (verl 0.9.1's pin).

Detected by feature (attribute present, import succeeds), not by version string. Each function names what it
papers over; the callers (pool_hooks, pool_switch, scheduler_hooks, engine) stay version-free. sglang is
imported inside the functions (scheduler processes import this module before SGLang's heavy imports).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from array import array
from collections.abc import Iterator
from typing import Any

import torch


# ---- parallel state ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def tp_group_patch(group) -> Iterator[None]:
    """Run under `group` as the TP group and the attention TP group. 0.5.23's `patch_tensor_parallel_group`
    swaps both (`owns_attention=True`); 0.5.12's swaps only `_TP`, while attention layers, the KV pool and
    the logits processor read `parallel_state._ATTN_TP` (dp_attention caches no attention-TP rank/size)."""
    from sglang.srt.distributed import parallel_state as ps

    if "owns_attention" in inspect.signature(ps.patch_tensor_parallel_group).parameters:
        with ps.patch_tensor_parallel_group(group, owns_attention=True):
            yield
        return
    saved = ps._ATTN_TP
    with ps.patch_tensor_parallel_group(group):
        ps._ATTN_TP = group
        try:
            yield
        finally:
            ps._ATTN_TP = saved


def tp_rank_size() -> tuple[int, int]:
    """(rank, size) of the TP group in effect (0.5.23: the runtime context; 0.5.12: parallel_state)."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        from sglang.srt.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    ctx = get_parallel()
    return int(ctx.tp_rank), int(ctx.tp_size)


# ---- scheduler output path -----------------------------------------------------------------------------------
def sender_wrapper_cls() -> type:
    try:
        from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    except ImportError:  # 0.5.12
        from sglang.srt.managers.scheduler import SenderWrapper
    return SenderWrapper


class _AbortOnly:
    """0.5.12's `send_to_tokenizer` on a rank other than 0: SGLang's is a no-op there (control answers stay
    with rank 0); pass on only the per-request abort outputs, which this rank's replica owns."""

    def __init__(self, sender) -> None:
        self.sender = sender

    def send_output(self, output, recv_obj=None) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        if isinstance(output, AbortReq):
            self.sender.send_output(output, recv_obj)


def install_output_sockets(scheduler, sender) -> None:
    """Make `sender` this scheduler's output path to the tokenizer manager (a rank other than 0)."""
    if hasattr(scheduler, "ipc_channels"):  # 0.5.23: a dataclass; aborts go through `send_abort_output`
        scheduler.ipc_channels = dataclasses.replace(scheduler.ipc_channels, send_to_detokenizer=sender)
        return
    scheduler.send_to_detokenizer = sender  # 0.5.12: plain attributes; aborts go through send_to_tokenizer
    scheduler.send_to_tokenizer = _AbortOnly(sender)


def route_abort_outputs(scheduler_cls) -> None:
    """0.5.23: queued-request aborts leave through `Scheduler.send_abort_output` (rank 0's socket); send them
    through the rank's own sender instead. 0.5.12 has no such method (`install_output_sockets` covers it)."""
    if not hasattr(scheduler_cls, "send_abort_output"):
        return
    orig = scheduler_cls.send_abort_output

    def send_abort_output(self, abort_req, req) -> None:
        sender = getattr(self, "_pat_sender", None)
        if sender is None:
            return orig(self, abort_req, req)
        sender.send_output(abort_req, req)

    scheduler_cls.send_abort_output = send_abort_output


# ---- scheduler input path ------------------------------------------------------------------------------------
def install_replica_input(leader_share, replica_broadcast, send_to_other_leaders) -> None:
    """Replace SGLang's input path (rank 0 reads, then one broadcast over the WORLD-sized TP group) with the pool's
    per-replica one (`replica_input`): `leader_share(pull_raw)` is what this rank's replica gets (None on a rank
    that does not lead), `replica_broadcast` spreads it over the replica. 0.5.23: the two steps of
    `SchedulerRequestReceiver.recv_requests` (its other steps stay); rank 0's own timeout aborts (`local_reqs`) go
    to every leader. 0.5.12: `Scheduler.recv_requests` is one method; the pool's engine (text only,
    skip_tokenizer_init, no DP attention, no pipeline) needs only its read and broadcast."""
    try:
        from sglang.srt.managers.scheduler_components.request_receiver import SchedulerRequestReceiver
    except ImportError:  # 0.5.12
        _install_replica_input_0512(leader_share, replica_broadcast)
        return
    orig_pull = SchedulerRequestReceiver._pull_raw_reqs

    def _pull_raw_reqs(self):
        return leader_share(lambda: orig_pull(self))

    def _broadcast_reqs_across_ranks(self, recv_reqs, local_reqs=None):
        if local_reqs:  # made on rank 0 only, which always leads its replica
            send_to_other_leaders(local_reqs)
            recv_reqs = [*(recv_reqs or []), *local_reqs]
        return replica_broadcast(recv_reqs)

    SchedulerRequestReceiver._pull_raw_reqs = _pull_raw_reqs
    SchedulerRequestReceiver._broadcast_reqs_across_ranks = _broadcast_reqs_across_ranks


def _install_replica_input_0512(leader_share, replica_broadcast) -> None:
    import zmq
    from sglang.srt.managers.scheduler import Scheduler

    def recv_requests(self):
        if self.recv_skipper is not None or self.input_blocker is not None:
            raise RuntimeError("SglPool: scheduler_recv_interval > 1 and SGLANG_ENABLE_COLOCATED_BATCH_GEN are not "
                               "supported (the pool routes every request itself)")

        def pull_raw() -> list:
            reqs: list = []
            for sock in (self.recv_from_tokenizer, self.recv_from_rpc):
                while not self.recv_limit_reached(len(reqs)):
                    try:
                        reqs.append(sock.recv_pyobj(zmq.NOBLOCK))
                    except zmq.ZMQError:
                        break
            return reqs

        return replica_broadcast(leader_share(pull_raw))

    Scheduler.recv_requests = recv_requests


def reset_admission_state(scheduler) -> None:
    """What SGLang resets when its running set changes or it goes idle, reset on every rank at a switch: the running
    batch's `batch_is_full` (set when admission failed for lack of room; only a later admission, a shrinking decode
    batch or a decode step that empties it clears it, not the `filter_batch` a switch's idle check runs) and the
    new-token ratio admission estimates with (decayed per decode step; 0.5.23: a tracker, 0.5.12: an attribute).
    The ranks of a new replica ran different loops before the switch; their admission must start equal, or one
    rank runs a prefill the other does not and their forwards' collectives no longer pair (seen in CI: a hang
    after a grow from a full TP1 replica, one rank in a prefill's all-reduce, the other in the input broadcast)."""
    if scheduler.running_batch is not None:
        scheduler.running_batch.batch_is_full = False
    tracker = getattr(scheduler, "new_token_ratio_tracker", None)
    if tracker is not None:
        tracker.reset()
    else:
        scheduler.new_token_ratio = scheduler.init_new_token_ratio


def admission_state(scheduler) -> dict:
    """The scheduler state its admission reads besides the queues (`reset_admission_state` resets it)."""
    tracker = getattr(scheduler, "new_token_ratio_tracker", None)
    ratio = tracker.current if tracker is not None else scheduler.new_token_ratio
    full = scheduler.running_batch is not None and bool(scheduler.running_batch.batch_is_full)
    return dict(batch_is_full=full, new_token_ratio=float(ratio))


# ---- build, attention, weights -------------------------------------------------------------------------------
def build_methods() -> list[tuple[type, str]]:
    """The methods that build the model, KV pool and attention backend and capture the start-up CUDA graphs, each to
    run under the base layout's group. 0.5.23: four Scheduler methods, called after the distributed init; the graphs
    are captured by `init_all_cuda_graphs`, which `init_model_worker` calls itself after the other three, so it is
    wrapped too (unwrapped, a TP2+ base would capture a WORLD-sized all-reduce: a hang or a sum over replicas on
    replay). 0.5.12: all four happen in `ModelRunner.initialize` (its `init_device_graphs` included); the
    distributed init runs earlier in ModelRunner.__init__ (so the scheduler's `init_tp_model_worker` is too early
    for the pool's groups)."""
    from sglang.srt.managers.scheduler import Scheduler

    if hasattr(Scheduler, "init_memory_pools"):
        return [(Scheduler, n) for n in ("init_tp_model_worker", "init_memory_pools", "init_all_attention_backends",
                                         "init_all_cuda_graphs")]
    from sglang.srt.model_executor.model_runner import ModelRunner

    return [(ModelRunner, "initialize")]


def startup_capture_method() -> tuple[type, str]:
    """The ModelRunner method SGLang captures its start-up graphs in (inside a `build_methods` one): 0.5.23
    `init_cuda_graphs` (from `Scheduler.init_all_cuda_graphs`), 0.5.12 `init_device_graphs` (from `initialize`)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    return ModelRunner, "init_cuda_graphs" if hasattr(ModelRunner, "init_cuda_graphs") else "init_device_graphs"


def input_sockets(scheduler) -> list:
    """Rank 0's zmq sockets SGLang reads requests from (tokenizer, RPC): 0.5.23 keeps them in `ipc_channels`."""
    ch = getattr(scheduler, "ipc_channels", scheduler)
    return [ch.recv_from_tokenizer, ch.recv_from_rpc]


def startup_load_and_kv_methods() -> tuple[tuple[type, str], tuple[type, str]]:
    """The ModelRunner methods that load the model and allocate the KV pool at start-up (reclaim_weight_memory adopts
    the weights after the first and the KV storages after the second, both before `startup_capture_method`).
    `load_model` in both versions; the KV pool: 0.5.23 `alloc_memory_pool` (from `Scheduler.init_memory_pools`),
    0.5.12 `init_memory_pool` (from `ModelRunner.initialize`, after `load_model`, before the attention backend and
    `init_device_graphs`)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    kv = "alloc_memory_pool" if hasattr(ModelRunner, "alloc_memory_pool") else "init_memory_pool"
    return (ModelRunner, "load_model"), (ModelRunner, kv)


def weight_update_method() -> tuple[type, str]:
    """Where a tensor weight update runs the weight loaders (to be wrapped with the layout's group)."""
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    except ImportError:  # 0.5.12
        from sglang.srt.model_executor.model_runner import ModelRunner

        return ModelRunner, "update_weights_from_tensor"
    return WeightUpdater, "update_weights_from_tensor"


def prefill_graph_off_args() -> dict[str, bool]:
    """ServerArgs that turn prefill CUDA graphs off. 0.5.12 captures piecewise prefill graphs unless
    `disable_piecewise_cuda_graph` (its runner keeps the base model's attention layers, so after a switch a
    prefill would replay modules the switch replaced); 0.5.23 spells it `disable_prefill_cuda_graph` (its
    `disable_cuda_graph` turns both phases off too; set explicitly all the same)."""
    from sglang.srt.server_args import ServerArgs

    # A field with a default is a class attribute in both (0.5.12: a dataclass; 0.5.23: assembled namespaces)
    return {n: True for n in ("disable_piecewise_cuda_graph", "disable_prefill_cuda_graph") if hasattr(ServerArgs, n)}


def weights_region(server_args, model_runner) -> contextlib.AbstractContextManager:
    """SGLang's memory-saver region for weights (the tag `release_memory_occupation(["weights"])` frees), with
    the CPU backup setting SGLang loaded the weights with. A no-op without the memory saver."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_WEIGHTS

    backup = bool(getattr(server_args, "enable_weights_cpu_backup", False))
    return model_runner.memory_saver_adapter.region(GPU_MEMORY_TYPE_WEIGHTS, enable_cpu_backup=backup)


def reinit_attention(tp_worker) -> None:
    """Re-create the attention backend(s) after a layout switch (they size per-head state at build time)."""
    if hasattr(tp_worker, "init_attention_backends"):
        tp_worker.init_attention_backends()
    else:  # 0.5.12
        tp_worker.model_runner.init_attention_backend()


ATTENTION_ATTRS = ("attn_backend", "decode_attn_backend", "decode_attn_backend_group")  # 0.5.12: the first only


def attention_state(runner) -> dict[str, Any]:
    """The model runner's attention backend attributes (what `reinit_attention` sets), to keep per layout."""
    return {a: getattr(runner, a) for a in ATTENTION_ATTRS if hasattr(runner, a)}


def set_attention_state(runner, state: dict[str, Any]) -> None:
    for a, v in state.items():
        setattr(runner, a, v)
    translator = getattr(runner, "kv_index_translator", None)  # 0.5.23 binds the backends it serves
    if translator is not None:
        translator.bind_and_verify_backends([runner.attn_backend, runner.decode_attn_backend])


def _graph_attr(runner) -> str:
    return "decode_cuda_graph_runner" if hasattr(runner, "init_decode_cuda_graph") else "graph_runner"  # 0.5.12


def graph_runner(runner) -> Any:
    """The model runner's decode graph runner (None where none was captured)."""
    return getattr(runner, _graph_attr(runner), None)


def set_graph_runner(runner, graphs: Any) -> None:
    setattr(runner, _graph_attr(runner), graphs)


def capture_decode_graphs(runner) -> Any:
    """Capture decode graphs for the current group, model and attention backends; returns the new runner.
    0.5.23: `init_decode_cuda_graph`; 0.5.12: `init_device_graphs` (decode graphs only there too)."""
    if hasattr(runner, "init_decode_cuda_graph"):
        runner.init_decode_cuda_graph()
    else:
        runner.init_device_graphs()
    return graph_runner(runner)


def weight_update_context(sgl) -> contextlib.AbstractContextManager:
    """0.5.23 brackets tensor weight updates with begin/end_weight_update; 0.5.12 has neither."""
    if not hasattr(sgl, "begin_weight_update"):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        sgl.begin_weight_update()
        try:
            yield
        finally:
            sgl.end_weight_update()

    return session()


# ---- radix cache and KV pool ---------------------------------------------------------------------------------
def _new_radix_api() -> bool:
    """0.5.23: MatchResult carries `device_prefix_len` (indices via `path_device_indices`), keys are arrays.
    0.5.12: MatchResult carries `device_indices`, keys are lists."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult

    return "device_prefix_len" in MatchResult._fields


def _radix_key(tokens: list[int]):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(token_ids=array("q", tokens) if _new_radix_api() else list(tokens))


def prefix_indices(tree, tokens: list[int]) -> torch.Tensor:
    """KV pool indices of the longest prefix of `tokens` cached in SGLang's radix tree (public match API)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    match = tree.match_prefix(MatchPrefixParams(key=_radix_key(tokens)))
    if not _new_radix_api():
        return match.device_indices
    if match.device_prefix_len == 0:
        return torch.empty(0, dtype=torch.int64)
    return tree.path_device_indices(match.last_device_node)[: match.device_prefix_len]


def insert_prefix(tree, tokens: list[int], slots: torch.Tensor) -> int:
    """Insert `tokens` -> KV `slots` into the radix tree; returns the length of the prefix already there."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    return int(tree.insert(InsertParams(key=_radix_key(tokens), value=slots)).prefix_len)


def refresh_kv_pointers(pool) -> None:
    """After `kv_room` re-viewed an MHA pool's K/V buffers: the per-buffer address / stride tables SGLang's KV
    copy kernels read (0.5.23: `_build_kv_buffer_descs` + `_init_data_ptrs_and_strides`; 0.5.12 builds them
    inline in `_create_buffers`, repeated here), and on CUDA the copy tiling, which follows the row size."""
    if hasattr(pool, "_init_data_ptrs_and_strides"):
        pool._kv_buffer_descs = pool._build_kv_buffer_descs()
        pool._init_data_ptrs_and_strides()
    else:  # 0.5.12
        bufs = [*pool.k_buffer, *pool.v_buffer]
        pool.k_data_ptrs = torch.tensor([x.data_ptr() for x in pool.k_buffer], dtype=torch.uint64, device=pool.device)
        pool.v_data_ptrs = torch.tensor([x.data_ptr() for x in pool.v_buffer], dtype=torch.uint64, device=pool.device)
        pool.data_ptrs = torch.cat([pool.k_data_ptrs, pool.v_data_ptrs], dim=0)
        pool.data_strides = torch.tensor([x[0].numel() * x.element_size() for x in bufs], device=pool.device)
    if getattr(pool, "_kv_copy_config", None) is not None:  # CUDA
        pool._init_kv_copy_and_warmup()


# ---- CPU-only workarounds inside scheduler processes ---------------------------------------------------------
def _torch_without_pinning() -> types.ModuleType:
    """`torch` as seen by one SGLang module, except that `torch.tensor` ignores `pin_memory`."""
    shim = types.ModuleType("torch")

    def tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)

    shim.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    shim.tensor = tensor
    return shim


def apply_cpu_workarounds() -> None:
    """Inside a scheduler process without CUDA. 0.5.12's LogitsProcessor builds index tensors with
    `torch.tensor(..., pin_memory=True)` unconditionally, which fails without an NVIDIA driver (0.5.23 asks
    `is_pin_memory_available()`). Give only that module a `torch` whose `tensor` drops the pinning: pinning
    is a transfer optimisation, the values are the same."""
    if torch.cuda.is_available():
        return
    from sglang.srt.layers import logits_processor

    if not hasattr(logits_processor, "is_pin_memory_available"):
        logits_processor.torch = _torch_without_pinning()


# ---- the engine's RPC socket ---------------------------------------------------------------------------------
def rpc_send(sock, obj) -> None:
    """0.5.23 frames IPC with `io_struct.sock_send` (pickle or msgpack); 0.5.12 sends pickled objects."""
    from sglang.srt.managers import io_struct

    if hasattr(io_struct, "sock_send"):
        io_struct.sock_send(sock, obj)
    else:
        sock.send_pyobj(obj)


def rpc_recv(sock):
    from sglang.srt.managers import io_struct

    return io_struct.sock_recv(sock) if hasattr(io_struct, "sock_recv") else sock.recv_pyobj()
