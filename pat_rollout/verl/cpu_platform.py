"""A CPU platform for verl's trainer (`python -m verl.trainer.main_ppo` on a host without accelerators).

Installed by `pat_rollout.verl.register` (the `verl.plugins` entry point) only when `VERL_PLATFORM=cpu`, so it
never affects a GPU machine. verl's device layer (`verl.utils.device` -> `verl.plugin.platform.get_platform`)
then reports device "cpu" and backend "gloo"; Ray still schedules trainer ranks on the "GPU" resource, which a CPU
host provides as fake GPUs (`+ray_kwargs.ray_init.num_gpus=N`). Ray workers inherit `VERL_PLATFORM` from a local
`ray.init`; with `ray job submit`, put it in the runtime env's env_vars.

Besides the platform, a few verl 0.9.1 code paths assume an accelerator; `install()` applies the smallest fix
for each (every fix names the verl function it targets). Supported on CPU: FSDP2 (`actor.strategy=fsdp2`,
`ref.strategy=fsdp2`, `critic.strategy=fsdp2`); FSDP1 refuses CPU parameters in `sync_module_states` and is not
patched. The fixes were written against one verl version; any other fails loudly at first use of the platform.
"""

from __future__ import annotations

import logging
import os
import types
from contextlib import contextmanager
from importlib.metadata import version as _dist_version
from typing import Any

logger = logging.getLogger(__name__)

PLATFORM_NAME = "cpu"
SUPPORTED_VERL = "0.9.1"  # the version whose code the fixes below were read from


def enabled() -> bool:
    """True where this process asked for the CPU platform (VERL_PLATFORM=cpu)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def check_verl_version(found: str | None = None) -> None:
    """RuntimeError unless verl is the version these fixes target."""
    found = found or _dist_version("verl")
    if found != SUPPORTED_VERL:
        raise RuntimeError(
            f"pat_rollout's CPU platform for verl (VERL_PLATFORM=cpu) was written for verl=={SUPPORTED_VERL}, "
            f"found verl=={found}: its fixes patch verl internals of that version. Install verl=={SUPPORTED_VERL} "
            "(`pip install -e .[verl]`) or unset VERL_PLATFORM to use verl's own platform detection.")


def _mem_get_info(*_: Any, **__: Any) -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _device_module() -> types.ModuleType:
    """`torch.cpu` plus the torch.cuda-style calls verl makes on `get_torch_device()` (memory stats for its
    logs, seeding, synchronize, the device name its flops counter looks up)."""
    import torch

    def noop(*_: Any, **__: Any) -> None:
        return None

    def zero(*_: Any, **__: Any) -> int:
        return 0

    mod = types.ModuleType("pat_rollout_cpu_device")
    mod.__getattr__ = lambda name: getattr(torch.cpu, name)  # the rest of torch.cpu (PEP 562)
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats", "ipc_collect"):
        setattr(mod, name, noop)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, zero)
    mod.current_device = lambda: PLATFORM_NAME
    mod.device_count = lambda: 1
    mod.is_available = lambda: True
    mod.mem_get_info = _mem_get_info
    mod.memory_stats = lambda *_, **__: {}
    mod.manual_seed = mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state, mod.set_rng_state = torch.get_rng_state, torch.set_rng_state
    mod.get_device_name = lambda *_, **__: "CPU"  # unknown to verl's flops table: MFU is logged as 0
    return mod


def _platform_class() -> type:
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl platform of a CPU-only host: device "cpu", gloo collectives, Ray's (fake) "GPU" resource."""

        device_name = PLATFORM_NAME
        vendor_name = PLATFORM_NAME
        _module: types.ModuleType | None = None

        @property
        def device_module(self) -> types.ModuleType:
            if PlatformCPU._module is None:
                PlatformCPU._module = _device_module()
            return PlatformCPU._module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return enabled()

        def current_device(self) -> str:
            # verl passes get_device_id() to .to(), device= and FSDP(device_id=): an int would mean accelerator 0.
            return PLATFORM_NAME

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            import torch

            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            self.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (fake) GPU resource

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU


def _unsupported_platform_class(error: RuntimeError) -> type:
    """A stand-in registered on a verl version mismatch: verl instantiates it at the first get_platform(), where
    it raises the version error (instead of verl's later "Unknown platform 'cpu'")."""
    from verl.plugin.platform import PlatformBase

    class UnsupportedVerl(PlatformBase):
        def __init__(self) -> None:
            raise error

    UnsupportedVerl.__abstractmethods__ = frozenset()
    return UnsupportedVerl


def _fix_process_group_backend() -> None:
    """verl.utils.distributed.initialize_global_process_group_ray builds the backend string
    f"cpu:gloo,{device}:{backend}", here "cpu:gloo,cpu:gloo", which torch rejects (duplicate device type).
    On CPU the one backend is plain "gloo"."""
    import verl.utils.distributed as dist

    original = dist.initialize_global_process_group_ray
    if getattr(original, "_pat_cpu", False):
        return

    def initialize_global_process_group_ray(timeout_second: Any = None, backend: str | None = None) -> None:
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._pat_cpu = True
    dist.initialize_global_process_group_ray = initialize_global_process_group_ray


def _fix_fsdp2_offload_pinning() -> None:
    """verl.workers.engine.fsdp.transformer_impl.FSDPEngine._build_fsdp_module gives forward-only FSDP2 modules (the
    reference policy) CPUOffloadPolicy(pin_memory=True); pinning needs an accelerator. transformer_impl imports the
    class from verl.utils.fsdp_utils, so that name becomes a subclass that never pins (imported before it)."""
    import verl.utils.fsdp_utils as fsdp_utils

    base = fsdp_utils.CPUOffloadPolicy
    if getattr(base, "_pat_cpu", False):
        return

    class UnpinnedCPUOffloadPolicy(base):
        _pat_cpu = True

        def __init__(self, pin_memory: bool = True) -> None:
            super().__init__(pin_memory=False)

    fsdp_utils.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def _fix_value_model_attention() -> None:
    """verl.utils.model.load_valuehead_model (the critic's model) loads AutoModelForTokenClassification with
    attn_implementation="flash_attention_2" hard-coded, a CUDA-only kernel. On CPU: the same load with "sdpa"
    (verl's fallback through trl's value-head wrapper is left out: token classification covers Llama/Qwen)."""
    import verl.utils.model as model_utils

    if getattr(model_utils.load_valuehead_model, "_pat_cpu", False):
        return

    def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            local_path, dtype=torch_dtype, config=model_config, attn_implementation="sdpa",
            trust_remote_code=trust_remote_code)

    load_valuehead_model._pat_cpu = True
    model_utils.load_valuehead_model = load_valuehead_model


def _fix_engine_lookup() -> None:
    """verl.workers.engine.base.EngineRegistry.get_engine_cls registers the FSDP engine for devices cuda/npu only;
    the engine itself is device-agnostic. VERL_ENGINE_DEVICE is verl's own override for that lookup."""
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")


def install() -> None:
    """Register the CPU platform with verl's PlatformRegistry and apply the CPU fixes (idempotent). On a verl
    version other than SUPPORTED_VERL, registers a platform that raises the version error at first use."""
    from verl.plugin.platform import PlatformRegistry

    try:
        check_verl_version()
    except RuntimeError as e:
        logger.error("%s", e)
        PlatformRegistry.register(platform=PLATFORM_NAME)(_unsupported_platform_class(e))
        return
    if PlatformRegistry.get(PLATFORM_NAME) is None:
        PlatformRegistry.register(platform=PLATFORM_NAME)(_platform_class())
    _fix_process_group_backend()
    _fix_fsdp2_offload_pinning()
    _fix_value_model_attention()
    _fix_engine_lookup()
