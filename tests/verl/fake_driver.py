"""A stand-in with RolloutDriver's public API, backed by a HuggingFace model on CPU (no TP, no reconfiguration).

Used by the verl wiring tests when the real driver (pat_rollout.driver) cannot run yet; the tests
pickle this module by value into Ray actors (ray.cloudpickle.register_pickle_by_value).
Greedy when temperature == 0; otherwise samples with a torch.Generator seeded by SamplingParams.seed.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Iterable
from typing import Any

from pat_rollout.types import Request, RequestOutput


class FakeRolloutDriver:
    def __init__(self, config: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from pat_rollout.layout import Layout

        self.config = config
        self.layout = Layout.uniform(config.num_devices, config.initial_tp)  # the fake never reconfigures
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32).eval()
        self.eos = set(self.model.config.eos_token_id if isinstance(self.model.config.eos_token_id, list)
                       else [self.model.config.eos_token_id])
        self._pool = cf.ThreadPoolExecutor(max_workers=1)
        self._lock = threading.Lock()
        self.released: set[str] = set()
        self.num_weight_updates = 0
        self._stage_t0: float | None = None
        self._lengths: list[int] = []

    def _run(self, req: Request) -> RequestOutput:
        import torch

        if self.released:
            raise RuntimeError(f"generate while released: {sorted(self.released)}")
        sp = req.sampling
        gen = torch.Generator().manual_seed(sp.seed)
        ids = list(req.prompt_token_ids)
        out_ids: list[int] = []
        log_probs: list[float] = []
        finish = "length"
        with torch.no_grad():
            for _ in range(sp.max_new_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                if sp.temperature == 0:
                    tok = int(logits.argmax())
                    lp = torch.log_softmax(logits, -1)
                else:
                    lp = torch.log_softmax(logits / sp.temperature, -1)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=gen))
                out_ids.append(tok)
                log_probs.append(float(lp[tok]))
                ids.append(tok)
                if (tok in self.eos and not sp.ignore_eos) or tok in sp.stop_token_ids:
                    finish = "stop"
                    break
        with self._lock:
            self._lengths.append(len(out_ids))
        return RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                             token_ids=tuple(out_ids), log_probs=tuple(log_probs), finish_reason=finish)

    def submit(self, request: Request) -> cf.Future:
        with self._lock:
            if self._stage_t0 is None:
                self._stage_t0 = time.perf_counter()
        return self._pool.submit(self._run, request)

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        return [f.result() for f in [self.submit(r) for r in requests]]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            if name not in params:
                raise KeyError(f"unknown weight {name!r}")
            params[name].data.copy_(t)
        self.num_weight_updates += 1

    def release(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        self.released |= set(tags)

    def resume(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        self.released -= set(tags)

    def abort_all(self) -> list[RequestOutput]:
        return []

    def stage_metrics(self) -> dict[str, float]:
        with self._lock:
            n = self._lengths
            return {"pat/gen_time_s": time.perf_counter() - (self._stage_t0 or time.perf_counter()),
                    "pat/num_reconfigs": 0.0, "pat/num_requests": float(len(n)),
                    "pat/response_length/max": float(max(n, default=0)),
                    "pat/num_weight_updates": float(self.num_weight_updates)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
