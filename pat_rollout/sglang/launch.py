"""Launch settings for real SGLang engines: the server kwargs pat_rollout uses and the process
environment SGLang's CPU path needs. Only `launch_engine` imports sglang.

CPU (tests, this machine): `SGLANG_USE_CPU_ENGINE=1`, device "cpu", the torch_native attention backend
(SGLang's default CPU backend needs AMX), float32, no CUDA graphs, and a `sgl_kernel` that imports
(the CPU stand-in in tests/sglang_backend/sgl_kernel_stub when the CUDA-only wheel does not).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.entrypoints.engine import Engine as SglEngine

MODEL_PACKAGE = "pat_rollout.sglang.models"


def engine_env(tp_size: int, device: str) -> dict[str, str]:
    """Environment for SGLang's scheduler processes (they are spawned and inherit os.environ)."""
    env = {"SGLANG_EXTERNAL_MODEL_PACKAGE": MODEL_PACKAGE}  # import 2 model files, not ~200
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # A CUDA build of torch makes PyNcclCommunicator load libnccl and then fail on a CPU device.
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent"
        if tp_size > 1:  # one core per rank; without it ranks > NUMA nodes fails at init
            cores = os.cpu_count() or 1
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cores) for r in range(tp_size))
    return env


def server_kwargs(model_path: str, *, tp_size: int, device: str = "cpu", **overrides: Any) -> dict[str, Any]:
    """ServerArgs for one pat_rollout replica: token ids in and out (no tokenizer), deterministic."""
    # incremental_streaming_output: each stream chunk carries only the tokens since the previous one (SGLang's
    # delta contract; engine._Tracked.add_chunk reads only those)
    kw: dict[str, Any] = dict(model_path=model_path, tp_size=tp_size, skip_tokenizer_init=True, random_seed=0,
                              skip_server_warmup=True, log_level="error", incremental_streaming_output=True)
    if device == "cpu":
        from pat_rollout.sglang import compat

        # every kind of graph off: 0.5.12 otherwise decides on piecewise prefill graphs by itself, and after some
        # SGLang modules were imported in this process it tried them on CPU (torch.cpu has no graph pool)
        kw.update(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                  disable_cuda_graph=True, dtype="float32", max_total_tokens=4096, mem_fraction_static=0.5,
                  **compat.prefill_graph_off_args())
    kw.update(overrides)
    return kw


@contextlib.contextmanager
def patched_environ(env: dict[str, str], unset: tuple[str, ...] = ()) -> Iterator[None]:
    """Set `env` (and drop `unset`) in os.environ for the block; restore afterwards."""
    keys = set(env) | set(unset)
    saved = {k: os.environ.get(k) for k in keys}
    try:
        for k in unset:
            os.environ.pop(k, None)
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_engine(model_path: str, *, tp_size: int = 1, device: str = "cpu", **overrides: Any) -> SglEngine:
    """Start one SGLang Engine (scheduler processes spawned here). Call from under `if __name__ == "__main__"`
    in scripts: SGLang spawns, so the main module is re-imported by its children."""
    from pat_rollout.sglang.rank_rpc import child_failed

    env = engine_env(tp_size, device)
    overrides.setdefault("custom_sigquit_handler", child_failed)  # a failed child must not SIGKILL this process
    with patched_environ(env, unset=("SGLANG_CPU_OMP_THREADS_BIND",)):
        # pat_rollout's scheduler entry point: its RPC methods, and the CPU workarounds SGLang 0.5.12 needs
        return pat_engine_class()(**server_kwargs(model_path, tp_size=tp_size, device=device, **overrides))


_ENGINE_CLS: type | None = None


def pat_engine_class() -> type:
    """`sglang.Engine` whose scheduler processes carry pat_rollout's hooks and RPC methods (scheduler_hooks)."""
    global _ENGINE_CLS
    if _ENGINE_CLS is None:
        from pat_rollout.sglang import inventory

        inventory.check_static()  # every SGLang name the backend uses, one error listing what moved
        from sglang.srt.entrypoints.engine import Engine as SglEngine

        from pat_rollout.sglang import scheduler_hooks

        class PatSglEngine(SglEngine):
            run_scheduler_process_func = staticmethod(scheduler_hooks.run_scheduler_process)

        _ENGINE_CLS = PatSglEngine
    return _ENGINE_CLS
