"""Waiting on an SglPool's per-rank state in tests (imported by the test modules beside it)."""

from __future__ import annotations

import asyncio
import time


def wait_info(pool, pred, what: str, timeout: float) -> list[dict]:
    """Every rank's `pat_pool_info` once `pred` holds; the client's loop runs meanwhile (it sends the requests
    and reads their streams). TimeoutError with the last (running, waiting) per rank after `timeout` s."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        info = pool.info()
        if pred(info):
            return info
        pool.client.loop.run_until_complete(asyncio.sleep(0.05))
    raise TimeoutError(f"{what} not seen in {timeout} s; last info: "
                       f"{[(i['num_running'], i['num_waiting']) for i in info]}")
