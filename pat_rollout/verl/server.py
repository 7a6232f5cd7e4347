"""The Ray server actor of one PAT replica: what verl's LLMServerClient and the load balancer call.

One `PatServer` owns one `RolloutDriver` (a PAT pool of `tp * dp` devices that regroups its TP layout during
generation). Requests arrive one per sample (`generate`), are submitted to the driver without blocking the
actor's event loop, and come back as verl `TokenOutput`s. Blocking driver calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pat_rollout.types import Request, RequestOutput, SamplingParams
from pat_rollout.verl.config import from_verl

if TYPE_CHECKING:
    import torch

    from pat_rollout.config import PatRolloutConfig

logger = logging.getLogger(__name__)

# verl's sampling dict keys we map; others are reported once and ignored (see _sampling_params).
_HANDLED_KEYS = {"temperature", "top_p", "top_k", "logprobs", "max_tokens", "max_new_tokens", "seed",
                 "stop_token_ids", "ignore_eos", "repetition_penalty"}
_STOP_REASONS = {"stop": "completed", "length": "length", "abort": "aborted"}


def request_seed(config_seed: int, request_id: str) -> int:
    """Per-request sampling seed: a stable hash of (config seed, request id), so the n samples of one prompt
    (distinct request ids) differ and a rerun with the same ids (verl's full_determinism) repeats."""
    digest = hashlib.blake2b(f"{config_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def model_local_path(model_config: Any) -> str:
    """The local model directory of verl's model config (HFModelConfig or its DictConfig)."""
    local = getattr(model_config, "local_path", None)
    return str(local or model_config.path)


def default_driver_factory(config: PatRolloutConfig) -> Any:
    from pat_rollout.driver import RolloutDriver

    return RolloutDriver(config)


class PatServer:
    """Ray actor (wrapped with `ray.remote` by PatReplica). Methods mirror verl's SGLangHttpServer."""

    def __init__(self, config: Any, model_config: Any, rollout_mode: Any, replica_rank: int,
                 driver_factory: Callable[[PatRolloutConfig], Any] | None = None,
                 visible_devices: str | None = None) -> None:
        """`visible_devices`: the pool's GPUs (hybrid mode: its trainer ranks' union); SGLang's ranks use them
        in this order, device d = the d-th visible GPU."""
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.device import get_visible_devices_keyword

        if visible_devices:
            os.environ[get_visible_devices_keyword()] = visible_devices

        self.config = omega_conf_to_dataclass(config)
        self.model_config = model_config
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.pat_config = from_verl(self.config, model_local_path(model_config))
        self._driver_factory = driver_factory or default_driver_factory
        self._driver: Any = None
        self.global_steps: int | None = None
        self._weight_sync_tp: int | None = None  # TP size the pool was in when the last weights were loaded
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._reject = False
        self._warned: set[str] = set()
        import ray

        self._address = ray.util.get_node_ip_address().strip("[]")
        self._port = 0

    # ---------------------------------------------------------------- lifecycle
    async def launch_server(self) -> None:
        from verl.utils.net_utils import get_free_port

        t0 = time.perf_counter()
        self._driver = await asyncio.to_thread(self._driver_factory, self.pat_config)
        # verl keys servers by "ip:port" and exposes it for OpenAI chat completion; PAT serves token-in/token-out
        # through this actor only, so the port is reserved (unique) but nothing listens on it.
        self._port, sock = get_free_port(self._address, with_alive_sock=True)
        self._port_sock = sock
        logger.info("PAT replica %d: driver up in %.1fs (%s)", self.replica_rank, time.perf_counter() - t0,
                    self.pat_config)

    def get_server_address(self) -> tuple[str, int]:
        return self._address, self._port

    async def shutdown(self) -> None:
        if self._driver is not None:
            await asyncio.to_thread(self._driver.shutdown)
            self._driver = None

    # ---------------------------------------------------------------- generation
    def _sampling_params(self, prompt_len: int, sampling: dict[str, Any], request_id: str) -> SamplingParams:
        cfg = self.config
        max_model_len = cfg.max_model_len or (cfg.prompt_length + cfg.response_length)
        max_possible = max_model_len - prompt_len
        if max_possible < 1:
            raise ValueError(f"prompt length {prompt_len} leaves no room in max_model_len={max_model_len}")
        if "max_new_tokens" in sampling:
            max_new = int(sampling["max_new_tokens"])
        elif "max_tokens" in sampling:
            max_new = int(sampling["max_tokens"])
        else:  # verl's SGLang default
            max_new = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        max_new = max(1, min(max_new, max_possible))
        for key in sorted(set(sampling) - _HANDLED_KEYS - self._warned):
            self._warned.add(key)
            logger.warning("PAT server ignores sampling param %r=%r", key, sampling[key])
        if float(sampling.get("repetition_penalty", 1.0)) != 1.0 and "repetition_penalty" not in self._warned:
            self._warned.add("repetition_penalty")
            logger.warning("PAT server ignores repetition_penalty=%s (not implemented)", sampling["repetition_penalty"])
        top_k = int(sampling.get("top_k", -1))
        seed = sampling.get("seed")
        return SamplingParams(
            max_new_tokens=max_new,
            temperature=float(sampling.get("temperature", cfg.temperature)),
            top_p=float(sampling.get("top_p", cfg.top_p)),
            top_k=top_k if top_k > 0 else -1,
            seed=int(seed) if seed is not None else request_seed(self.pat_config.seed, request_id),
            stop_token_ids=tuple(int(t) for t in sampling.get("stop_token_ids") or ()),
            ignore_eos=bool(sampling.get("ignore_eos", False)),
        )

    async def generate(self, prompt_ids: Any, sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or kwargs.get("audio_data"):
            raise ValueError(f"request {request_id}: the pat rollout is text-only (got multimodal data)")
        if not self._resumed.is_set():
            if self._reject:
                raise RuntimeError(f"request {request_id} rejected: PAT replica {self.replica_rank} is paused")
            await self._resumed.wait()
        prompt = tuple(int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids))
        sampling = self._sampling_params(len(prompt), dict(sampling_params), request_id)
        req = Request(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
        out: RequestOutput = await asyncio.wrap_future(self._driver.submit(req))
        want_logprobs = bool(sampling_params.get("logprobs", False))
        return TokenOutput(
            token_ids=list(out.token_ids),
            log_probs=[float(x) for x in out.log_probs] if want_logprobs else None,
            stop_reason=_STOP_REASONS.get(out.finish_reason),
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

    # ---------------------------------------------------------------- memory and weights
    async def release(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        if self.config.free_cache_engine:
            await asyncio.to_thread(self._driver.release, tuple(tags))

    async def resume(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        if self.config.free_cache_engine:
            await asyncio.to_thread(self._driver.resume, tuple(tags))

    async def sleep(self) -> None:
        """End of a generation stage (verl's sleep_replicas): log its metrics, then free device memory."""
        logger.info("PAT replica %d stage metrics: %s", self.replica_rank,
                    await asyncio.to_thread(self._driver.stage_metrics))
        await self.release(("weights", "kv_cache"))

    async def wake_up(self) -> None:
        await self.resume(("weights", "kv_cache"))

    async def release_kv_cache(self) -> None:
        await self.release(("kv_cache",))

    async def resume_kv_cache(self) -> None:
        await self.resume(("kv_cache",))

    async def clear_kv_cache(self) -> None:
        """No prefix cache survives a request in PAT's engines, so there is nothing to flush."""

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of full HF-named tensors, in the layout the next stage starts in (the driver picks it:
        RolloutDriver.update_weights)."""
        await asyncio.to_thread(self._driver.update_weights, named_tensors)
        self._weight_sync_tp = self._driver.layout.tp_size

    async def set_global_steps(self, global_steps: int | None) -> None:
        self.global_steps = global_steps

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """Pause admission and abort running requests (their callers get stop_reason "aborted")."""
        self._resumed.clear()
        self._reject = reject_request
        await asyncio.to_thread(self._driver.abort_all)

    async def resume_generation(self) -> None:
        self._reject = False
        self._resumed.set()

    # ---------------------------------------------------------------- metrics and profiling
    async def get_metrics(self) -> dict[str, float]:
        """`pat/*` metrics of the last generation stage (RolloutDriver.stage_metrics), plus
        `pat/stage_end_tp`: the TP size of the pool's layout now, i.e. where the stage ended (verl reads metrics
        before its weight update), and `pat/weight_sync_tp`: the TP size the pool was in when the latest weights
        were loaded (the base layout's, since the driver returns there first; absent before the first update)."""
        metrics = await asyncio.to_thread(self._driver.stage_metrics)
        metrics = {**metrics, "pat/replica_rank": float(self.replica_rank),
                   "pat/stage_end_tp": float(self._driver.layout.tp_size)}
        if self._weight_sync_tp is not None:
            metrics["pat/weight_sync_tp"] = float(self._weight_sync_tp)
        return metrics

    async def start_profile(self, **kwargs: Any) -> None:
        logger.warning("PAT server: start_profile is not implemented; ignored")

    async def stop_profile(self) -> None:
        pass
