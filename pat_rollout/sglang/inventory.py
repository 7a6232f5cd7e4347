"""Every SGLang name pat_rollout/sglang/ reads, calls or patches, checked against the installed SGLang in one pass,
so that an SGLang upgrade fails at start-up with ONE error listing everything that moved (and the installed
version), instead of an AttributeError inside a scheduler process mid-switch.

A name is `"module:attr.path"` (importable; a dataclass field counts), `"module:callable(param)"` (the signature
has `param`), or `"root:attr.path"` on a live object (`engine`: the `sglang.Engine` in the driver process,
`scheduler`: a `Scheduler` in its own process, `world`: its WORLD `GroupCoordinator`). An entry's spellings are alternatives, one per SGLang version
where they differ (`compat.py` picks between them by feature); `" + "` joins names one spelling needs together.
- `STATIC`: importable names, checked before the engine starts (`check_static`, from `launch.pat_engine_class`,
  with the engine's environment set);
- `ENGINE` / `SCHEDULER`: attributes set in `__init__` (not on the class), checked right after start-up
  (`SGLangEngine.__init__`; `SglPool.__init__` via the `pat_check_inventory` RPC on every rank).
Only stdlib at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any

TESTED_VERSIONS = ("0.5.12", "0.5.23")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """One SGLang name the backend touches. `spellings`: alternatives, any one suffices (each a name or names
    joined by " + "); `used_by`: where and why."""

    spellings: tuple[str, ...]
    used_by: str

    def __post_init__(self) -> None:
        bad = [n for s in self.spellings for n in s.split(" + ") if ":" not in n]
        if not self.spellings or bad:
            raise ValueError(f"Need(spellings={self.spellings!r}, used_by={self.used_by!r}): every name must be "
                             f"'module-or-root:attr.path', got {bad}")


def _n(used_by: str, *spellings: str) -> Need:
    return Need(spellings=spellings, used_by=used_by)


PS = "sglang.srt.distributed.parallel_state"
SCHED = "sglang.srt.managers.scheduler"
ENG = "sglang.srt.entrypoints.engine:Engine"
MC = "sglang.srt.mem_cache"
RR = "sglang.srt.managers.scheduler_components.request_receiver:SchedulerRequestReceiver"
MR = "sglang.srt.model_executor.model_runner:ModelRunner"
TPW = "sglang.srt.managers.tp_worker:TpModelWorker"
SA = "sglang.srt.server_args:ServerArgs"
WU = "sglang.srt.model_executor.model_runner_components.weight_updater:WeightUpdater"
# ServerArgs fields launch.server_kwargs / pool.launch_pool_engine set (and the tests' overrides).
SERVER_ARGS = ("model_path", "tp_size", "skip_tokenizer_init", "random_seed", "skip_server_warmup", "log_level",
               "device", "attention_backend", "sampling_backend", "disable_cuda_graph", "dtype", "max_total_tokens",
               "mem_fraction_static", "disable_overlap_schedule", "enable_memory_saver", "watchdog_timeout",
               "base_gpu_id", "max_running_requests", "incremental_streaming_output")

STATIC: tuple[Need, ...] = (
    # launch: the engine class and its settings
    _n("launch.pat_engine_class: scheduler entry point", f"{ENG}.run_scheduler_process_func"),
    _n("scheduler_hooks.run_scheduler_process", f"{SCHED}:run_scheduler_process"),
    *(_n("launch.server_kwargs", f"{SA}.{f}") for f in SERVER_ARGS),
    _n("compat.prefill_graph_off_args (0.5.12 piecewise, 0.5.23 prefill graphs)",
       f"{SA}.disable_piecewise_cuda_graph", f"{SA}.disable_prefill_cuda_graph"),
    _n("compat.weights_region", "sglang.srt.constants:GPU_MEMORY_TYPE_WEIGHTS",),
    # engine.py / pool.py: Engine methods
    *(_n("engine.SGLangEngine", f"{ENG}.{m}") for m in (
        "async_generate", "collective_rpc", "update_weights_from_tensor", "release_memory_occupation",
        "resume_memory_occupation", "shutdown")),
    _n("engine.SGLangEngine.export_requests, abort_all",
       "sglang.srt.managers.tokenizer_manager:TokenizerManager.abort_request(rid)"
       " + sglang.srt.managers.tokenizer_manager:TokenizerManager.abort_request(abort_all)"),
    # parallel state
    _n("compat.tp_group_patch: TP and attention-TP group",
       f"{PS}:patch_tensor_parallel_group(owns_attention)", f"{PS}:patch_tensor_parallel_group + {PS}:_ATTN_TP"),
    _n("compat.tp_rank_size", "sglang.srt.runtime_context:get_parallel",
       f"{PS}:get_tensor_model_parallel_rank + {PS}:get_tensor_model_parallel_world_size"),
    _n("pool_hooks._build_groups, pool_switch._world", f"{PS}:get_world_group"),
    _n("pool_hooks._build_groups", f"{PS}:init_model_parallel_group(use_pynccl) + "
       f"{PS}:init_model_parallel_group(use_custom_allreduce) + {PS}:init_model_parallel_group(group_name)"),
    # Scheduler: pat_* RPCs are set on it; methods patched
    _n("scheduler_hooks.install: pat_* RPC methods", f"{SCHED}:Scheduler"),
    _n("pool_hooks._install_output_path (patched)", f"{SCHED}:Scheduler.init_ipc_channels"),
    _n("pool_hooks._install_routing (patched; the lockstep fallback input path)", f"{SCHED}:Scheduler.process_input_requests"),
    _n("compat.install_replica_input (patched: per-replica input; 0.5.12: the whole method)",
       f"{RR}._pull_raw_reqs + {RR}._broadcast_reqs_across_ranks",
       f"{SCHED}:Scheduler.recv_requests + {SCHED}:Scheduler.recv_limit_reached"),
    _n("replica_input.route", "sglang.srt.managers.io_struct:BatchTokenizedGenerateReqInput.batch + "
       "sglang.srt.managers.io_struct:RpcReqInput"),
    _n("replica_input.replica_broadcast", "sglang.srt.utils:broadcast_pyobj"),
    _n("compat.reset_admission_state (0.5.12: Scheduler.new_token_ratio, set in __init__)",
       "sglang.srt.managers.scheduler_components.new_token_ratio_tracker:NewTokenRatioTracker.reset",
       f"{SCHED}:Scheduler.on_idle"),
    _n("compat.reset_admission_state", "sglang.srt.managers.schedule_batch:ScheduleBatch.batch_is_full"),
    _n("pool_hooks._install_idle_sleep (patched: called when the rank is fully idle)",
       f"{SCHED}:Scheduler.maybe_sleep_on_idle"),
    _n("replica_input.open_sockets", "sglang.srt.server_args:PortArgs.scheduler_input_ipc_name"),
    _n("compat.build_methods (patched: built under the base layout)",
       f"{SCHED}:Scheduler.init_memory_pools + {SCHED}:Scheduler.init_tp_model_worker + "
       f"{SCHED}:Scheduler.init_all_attention_backends", f"{MR}.initialize"),
    _n("compat.startup_load_and_kv_methods (patched: reclaim_weight_memory adopts at start-up)",
       f"{MR}.load_model + {MR}.alloc_memory_pool", f"{MR}.load_model + {MR}.init_memory_pool"),
    _n("pool_hooks._install_build_and_forward (patched)", f"{TPW}.forward_batch_generation"),
    _n("compat.weight_update_method (patched), compat.weight_update_context",
       f"{WU}.update_weights_from_tensor + {ENG}.begin_weight_update + {ENG}.end_weight_update",
       f"{MR}.update_weights_from_tensor"),
    _n("compat.reinit_attention", f"{TPW}.init_attention_backends", f"{MR}.init_attention_backend"),
    _n("compat.capture_decode_graphs, compat.graph_runner (layout_graphs)", f"{MR}.init_decode_cuda_graph",
       f"{MR}.init_device_graphs"),
    # output path
    _n("compat.sender_wrapper_cls", "sglang.srt.managers.scheduler_components.output_sender:SenderWrapper.send_output",
       f"{SCHED}:SenderWrapper.send_output"),
    _n("compat.route_abort_outputs (0.5.23; 0.5.12: compat._AbortOnly on send_to_tokenizer)",
       f"{SCHED}:Scheduler.send_abort_output", "sglang.srt.managers.io_struct:AbortReq"),
    _n("replica_input.route", "sglang.srt.managers.io_struct:TokenizedGenerateReqInput.rid"),
    _n("pool_hooks._install_output_path", "sglang.srt.utils.network:get_zmq_socket",),
    _n("pool_hooks._install_output_path", "sglang.srt.server_args:PortArgs.tokenizer_ipc_name"),
    # sampling: every rank of a new replica reseeded alike (pool_switch._reseed); the tests' sampled-id log
    _n("pool_switch._reseed", "sglang.srt.utils:set_random_seed"),
    # rank_rpc.call: the engine's RPC socket, read with a deadline (collective_rpc waits forever)
    _n("rank_rpc.call", "sglang.srt.managers.io_struct:RpcReqInput + sglang.srt.managers.io_struct:RpcReqOutput"),
    _n("compat.rpc_send / rpc_recv (0.5.23; 0.5.12 pickles)",
       "sglang.srt.managers.io_struct:sock_send + sglang.srt.managers.io_struct:sock_recv",
       "sglang.srt.managers.io_struct:RpcReqInput"),
    _n("pool.pool_engine_args: a child's SIGQUIT must not kill the driver", f"{SA}.custom_sigquit_handler"),
    _n("debug_hooks.install (patched; tests only)", f"{SCHED}:Scheduler.process_batch_result"),
    _n("debug_hooks._install_step_log (tests only)", "sglang.srt.managers.schedule_batch:ScheduleBatch.forward_mode",
       "sglang.srt.managers.schedule_batch:ModelWorkerBatch.forward_mode"),
    # sampling: the `sampling_seed` key of every sampled request
    _n("engine.sglang_sampling_params (0.5.23: a msgspec field; 0.5.12: set in __init__)",
       "sglang.srt.sampling.sampling_params:SamplingParams.sampling_seed",
       "sglang.srt.sampling.sampling_params:SamplingParams.__init__(sampling_seed)"),
    # radix cache, KV pool, batches
    _n("compat._new_radix_api, prefix_indices",
       f"{MC}.base_prefix_cache:MatchResult.device_prefix_len + {MC}.base_prefix_cache:MatchResult.last_device_node"
       f" + {MC}.radix_cache:RadixCache.path_device_indices", f"{MC}.base_prefix_cache:MatchResult.device_indices"),
    _n("compat.prefix_indices, insert_prefix", f"{MC}.base_prefix_cache:MatchPrefixParams(key) + "
       f"{MC}.base_prefix_cache:InsertParams(key) + {MC}.base_prefix_cache:InsertParams(value)"),
    _n("compat._radix_key", f"{MC}.radix_cache:RadixKey(token_ids)"),
    _n("compat.prefix_indices, insert_prefix, pool_switch._flush",
       f"{MC}.radix_cache:RadixCache.match_prefix + {MC}.radix_cache:RadixCache.insert + "
       f"{MC}.radix_cache:RadixCache.reset"),
    _n("compat.refresh_kv_pointers (0.5.23; 0.5.12 builds the tables inline)",
       f"{MC}.memory_pool:MHATokenToKVPool._build_kv_buffer_descs + "
       f"{MC}.memory_pool:MHATokenToKVPool._init_data_ptrs_and_strides + "
       f"{MC}.memory_pool:MHATokenToKVPool._init_kv_copy_and_warmup",
       f"{MC}.memory_pool:MHATokenToKVPool._init_kv_copy_and_warmup"),
    _n("kv_room._set_limits", f"{TPW}.get_worker_info + {MR}.max_token_pool_size"),
    _n("pool_switch._flush", f"{MC}.memory_pool:ReqToTokenPool.clear"),
    _n("pool_switch._flush, _insert_prefix", f"{MC}.allocator:TokenToKVPoolAllocator.clear + "
       f"{MC}.allocator:TokenToKVPoolAllocator.alloc + {MC}.allocator:TokenToKVPoolAllocator.free"),
    _n("pool_switch._check_idle, pat_switch", "sglang.srt.managers.schedule_batch:ScheduleBatch.filter_batch + "
       "sglang.srt.managers.schedule_batch:ScheduleBatch.reqs + sglang.srt.managers.schedule_batch:Req.finished"),
    # models (live_model.rebuild_model_for_current_tp rebuilds them with their own constructor)
    *(_n(f"models/{m}.py, live_model.rebuild_model_for_current_tp",
         f"sglang.srt.models.{m}:{c}.__init__(config) + sglang.srt.models.{m}:{c}.__init__(quant_config)")
      for m, c in (("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"))),
    # CPU workaround: 0.5.12's logits processor pins memory unconditionally
    _n("compat.apply_cpu_workarounds", "sglang.srt.layers.logits_processor:is_pin_memory_available",
       "sglang.srt.layers.logits_processor:torch"),
)

ENGINE: tuple[Need, ...] = (
    _n("engine.SGLangEngine: KV pool size", "engine:_scheduler_init_result.scheduler_infos"),
    _n("engine.SGLangEngine: its asyncio loop", "engine:loop"),
    _n("engine.SGLangEngine: aborts", "engine:tokenizer_manager"),
    _n("rank_rpc.call: pat_* RPCs with a deadline", "engine:send_to_rpc"),
)

_RUNNER = "scheduler:tp_worker.model_runner"
# Not listed: `cur_batch_for_debug`, which pool_switch._flush only clears (0.5.12 sets it on the first batch).
SCHEDULER: tuple[Need, ...] = (
    _n("pool_switch, live_model: the live model", f"{_RUNNER}.model.model.embed_tokens.num_embeddings_padded"
       f" + {_RUNNER}.model.config"),
    _n("live_model._hf_config_dict", f"{_RUNNER}.model_config.hf_config.to_dict"),
    _n("pool_switch: KV pool", *(" + ".join(f"{_RUNNER}.token_to_kv_pool.{a}" for a in (
        "k_buffer", "v_buffer", "head_num", "head_dim", "row_dim", "v_head_dim", "size", "page_size",
        "layer_num", "device")),)),
    _n("kv_room._set_limits: SGLang's token limits", " + ".join(
        [f"{_RUNNER}.{a}" for a in ("max_total_num_tokens", "model_config.context_len")]
        + [f"scheduler:{a}" for a in ("max_total_num_tokens", "max_req_len", "max_req_input_len",
                                      "token_to_kv_pool_allocator.size", "token_to_kv_pool_allocator.page_size")])),
    _n("pool_switch._check_idle, _flush, pat_switch", " + ".join(f"scheduler:{a}" for a in (
        "running_batch", "waiting_queue", "chunked_req", "last_batch", "tree_cache",
        "req_to_token_pool", "token_to_kv_pool_allocator", "skip_tokenizer_init"))),
    # `result_queue` exists only in the overlap event loop, which _drain reads only when enable_overlap is set
    _n("pool_switch._drain: the overlap loop's queued result", "scheduler:enable_overlap"),
    _n("pool_switch._reseed: the engine's seed", "scheduler:server_args.random_seed"),
    _n("compat.weights_region: reshard/restore allocations", f"{_RUNNER}.memory_saver_adapter.region"),
    _n("compat.input_sockets: rank 0's request sockets (idle sleep)",
       "scheduler:ipc_channels.recv_from_tokenizer + scheduler:ipc_channels.recv_from_rpc",
       "scheduler:recv_from_tokenizer + scheduler:recv_from_rpc"),
    _n("compat.install_output_sockets", "scheduler:ipc_channels.send_to_detokenizer",
       "scheduler:send_to_detokenizer + scheduler:send_to_tokenizer"),
    _n("pool_hooks._build_groups, pool_switch._transport: the WORLD group", " + ".join(
        f"world:{a}" for a in ("local_rank", "rank_in_group", "device_group", "cpu_group", "world_size"))),
)


def _resolve(name: str, roots: dict[str, Any]) -> bool:
    """Whether one name ("module:a.b", "module:f(param)" or "root:a.b") resolves."""
    head, _, path = name.partition(":")
    param = None
    if path.endswith(")"):
        path, _, param = path[:-1].partition("(")
    if head in roots:
        obj = roots[head]
    else:
        try:
            obj = importlib.import_module(head)
        except ImportError:
            return False
    for part in path.split(".") if path else ():
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}:
            return param is None  # a field without a class default: present, nothing further to look into
        else:
            return False
    if param is not None:
        try:
            return param in inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return False
    return True


def missing(needs: tuple[Need, ...], roots: dict[str, Any] | None = None) -> list[str]:
    """One line per entry of `needs` none of whose spellings fully resolves, naming what each spelling lacks."""
    out = []
    for need in needs:
        lacks = [[n for n in s.split(" + ") if not _resolve(n, roots or {})] for s in need.spellings]
        if all(lacks):
            out.append(" or ".join(f"[{', '.join(x)}]" for x in lacks) + f"  (used by {need.used_by})")
    return out


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def error_message(lines: list[str], where: str) -> str:
    head = (f"pat_rollout's SGLang backend: {len(lines)} SGLang name(s) it uses moved or are missing ({where}) in the "
            f"installed sglang {installed_version()}; tested versions: {', '.join(TESTED_VERSIONS)}. Missing:")
    tail = ("Port the backend (pat_rollout/sglang/compat.py holds every version difference, inventory.py every "
            "name) or install a tested version (pat_rollout/sglang/INSTALL.md).")
    return "\n".join([head, *(f"  - {x}" for x in lines), tail])


@functools.cache
def check_static() -> None:
    """Raise one RuntimeError listing every STATIC name that does not resolve (once per process)."""
    lines = missing(STATIC)
    if lines:
        raise RuntimeError(error_message(lines, "checked before the engine starts"))


def check_live(needs: tuple[Need, ...], **roots: Any) -> list[str]:
    """The entries of `needs` missing on the live objects `roots` (by the root names they use), as message lines."""
    return missing(needs, roots)
