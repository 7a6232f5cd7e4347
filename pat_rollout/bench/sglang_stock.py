"""The stock baseline of the SGLang benchmarks: unmodified `sglang.Engine`s, driven the same way as the pool.

`launch_stock_engine` starts a plain `sglang.Engine` (no pat_rollout scheduler hooks) with the launch settings
pat_rollout's engines use (`launch.server_kwargs`, `launch.engine_env`). `Replicas` drives requests on a set of
`SGLangEngine` replicas (N stock engines, or the replicas of one SglPool) with the same driver-side code, and
`ChunkClock` times their streams, so a stock-vs-pool ratio measures the engines, not two different drivers.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pat_rollout.types import Request, RequestOutput

if TYPE_CHECKING:
    from pat_rollout.sglang.engine import SGLangEngine


def launch_stock_engine(model_path: str, *, tp_size: int, device: str, index: int = 0, **overrides: Any):
    """An unmodified `sglang.Engine` at `tp_size`. `index`: which of several engines of this TP this is; on CPU a
    TP1 engine's rank is bound to core `index` (a pool's ranks are bound one core each, see launch.engine_env), on
    GPU its ranks start at device `index * tp_size`."""
    from sglang.srt.entrypoints.engine import Engine

    from pat_rollout.sglang.launch import engine_env, patched_environ, server_kwargs

    env = engine_env(tp_size, device)
    if device == "cpu" and tp_size == 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
    elif device != "cpu":
        overrides.setdefault("base_gpu_id", index * tp_size)
    with patched_environ(env, unset=("SGLANG_CPU_OMP_THREADS_BIND",)):
        return Engine(**server_kwargs(model_path, tp_size=tp_size, device=device, **overrides))


@dataclass
class ChunkClock:
    """Arrival time and size of every stream chunk of the requests of some engines (wraps `async_generate` of
    each engine). A request's decode step time: (last chunk - first chunk) / tokens after the first chunk, i.e.
    the time between its tokens once prefilled, as the driver sees it."""

    chunks: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # SGLang rid -> (time, tokens)

    def attach(self, engine: SGLangEngine) -> None:
        generate = engine.sgl.async_generate

        async def timed(*args: Any, **kwargs: Any):
            gen = await generate(*args, **kwargs)
            log = self.chunks.setdefault(kwargs["rid"], [])

            async def chunks():
                async for c in gen:
                    log.append((time.perf_counter(), len(c["output_ids"])))
                    yield c
            return chunks()

        engine.sgl.async_generate = timed

    def step_times(self) -> list[float]:
        """Decode step time of every request streamed since the last `clear` that decoded after its first chunk."""
        out = []
        for log in self.chunks.values():
            num_after_first = sum(n for _t, n in log[1:])
            if num_after_first:
                out.append((log[-1][0] - log[0][0]) / num_after_first)
        return out

    def clear(self) -> None:
        self.chunks.clear()


@dataclass
class Replicas:
    """Replicas to serve requests on: (engine, replica index in the engine's rids) pairs. Requests are dealt
    round-robin over them, as equal-count balancing would."""

    targets: list[tuple[SGLangEngine, int]]
    clock: ChunkClock = field(default_factory=ChunkClock)

    def __post_init__(self) -> None:
        for eng in {id(e): e for e, _r in self.targets}.values():
            self.clock.attach(eng)

    def generate(self, requests: list[Request]) -> tuple[list[RequestOutput], float]:
        """Outputs in request order and the wall time from submission to the last output."""
        engines = list({id(e): e for e, _r in self.targets}.values())
        if len({id(e.loop) for e in engines}) != 1:
            raise RuntimeError("Replicas: the engines run on different asyncio loops; start them in one thread")
        self.clock.clear()
        t0 = time.perf_counter()
        for i, (eng, replica) in enumerate(self.targets):
            eng.add_requests(requests[i::len(self.targets)], replica=replica)
        outs: dict[str, RequestOutput] = {}
        for eng in engines:  # one loop: while one engine's requests are awaited, the others' progress too
            outs.update((o.request_id, o) for o in eng.run_to_completion())
        elapsed = time.perf_counter() - t0
        return [outs[r.request_id] for r in requests], elapsed

    def median_step_s(self) -> float:
        return statistics.median(self.clock.step_times())
