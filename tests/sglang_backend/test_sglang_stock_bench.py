"""The stock-baseline helpers of bench/sglang_pat_vs_static (`bench.sglang_stock`) on fake engines, without SGLang:
requests are dealt round-robin and come back in request order, and the chunk clock's decode step time is the
time between a request's first and last chunk over the tokens after the first."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pat_rollout.bench import sglang_stock
from pat_rollout.bench.sglang_stock import ChunkClock, Replicas
from pat_rollout.types import Request, RequestOutput, SamplingParams


class _FakeSgl:
    def __init__(self, chunk_sizes: list[int]) -> None:
        self.chunk_sizes = chunk_sizes

    async def async_generate(self, **kwargs):
        async def gen():
            for n in self.chunk_sizes:
                yield {"output_ids": [7] * n}
        return gen()


class _FakeEngine:
    """Records which replica each request went to; streams `chunk_sizes` through `sgl` per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, chunk_sizes: list[int]) -> None:
        self.loop, self.sgl = loop, _FakeSgl(chunk_sizes)
        self.added: list[tuple[str, int]] = []  # not yet run
        self.history: list[tuple[str, int]] = []  # every (request id, replica) added

    def add_requests(self, requests, replica: int = 0) -> None:
        self.added += [(r.request_id, replica) for r in requests]
        self.history += [(r.request_id, replica) for r in requests]

    def run_to_completion(self) -> list[RequestOutput]:
        async def consume(rid: str) -> None:
            async for _c in await self.sgl.async_generate(rid=f"{rid}-rid"):
                pass

        async def consume_all() -> None:
            await asyncio.gather(*(consume(rid) for rid, _r in self.added))

        self.loop.run_until_complete(consume_all())
        outs = [RequestOutput(request_id=rid, prompt_token_ids=(1,), token_ids=(7,), log_probs=(0.0,),
                              finish_reason="length") for rid, _r in self.added]
        self.added = []
        return outs


def _requests(n: int) -> list[Request]:
    return [Request(request_id=f"q{i}", prompt_token_ids=(1, 2), sampling=SamplingParams(max_new_tokens=4))
            for i in range(n)]


def test_replicas_deal_round_robin_and_keep_request_order():
    loop = asyncio.new_event_loop()
    try:
        a, b = _FakeEngine(loop, [1]), _FakeEngine(loop, [1])
        reps = Replicas([(a, 0), (b, 0), (a, 1)])
        reqs = _requests(7)
        outs, secs = reps.generate(reqs)
        assert [o.request_id for o in outs] == [r.request_id for r in reqs]
        assert a.history == [("q0", 0), ("q3", 0), ("q6", 0), ("q2", 1), ("q5", 1)]
        assert b.history == [("q1", 0), ("q4", 0)]
        assert secs >= 0
    finally:
        loop.close()


def test_engines_on_different_loops_are_refused():
    loops = [asyncio.new_event_loop(), asyncio.new_event_loop()]
    try:
        reps = Replicas([(_FakeEngine(loops[0], [1]), 0), (_FakeEngine(loops[1], [1]), 0)])
        with pytest.raises(RuntimeError, match="different asyncio loops"):
            reps.generate(_requests(2))
    finally:
        for lp in loops:
            lp.close()


def test_chunk_clock_step_time(monkeypatch):
    """Chunks of 1, 2 and 3 tokens at t = 0, 1, 2 s: (2 - 0) / (2 + 3) = 0.4 s per token."""
    ticks = itertools.count()
    monkeypatch.setattr(sglang_stock.time, "perf_counter", lambda: float(next(ticks)))
    loop = asyncio.new_event_loop()
    try:
        eng = _FakeEngine(loop, [1, 2, 3])
        clock = ChunkClock()
        clock.attach(eng)
        eng.add_requests(_requests(1))
        eng.run_to_completion()
        assert clock.step_times() == [pytest.approx(0.4)]
        clock.clear()
        assert clock.step_times() == []
    finally:
        loop.close()
