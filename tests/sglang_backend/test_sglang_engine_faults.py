"""A standalone SGLangEngine whose scheduler dies: the wait raises WorkerError naming the dead process; this process
lives on (SGLang's own SIGQUIT handler would SIGKILL the whole process tree, a test run or verl's worker with it:
`launch_engine` installs `rank_rpc.child_failed`, which only logs)."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.driver.errors import WorkerError  # noqa: E402
from pat_rollout.types import Request, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_killed_scheduler_raises_instead_of_killing_this_process(tiny_models):
    import psutil

    from pat_rollout.sglang.engine import SGLangEngine

    eng = SGLangEngine(tiny_models["llama"], tp_size=1, watchdog_timeout=120)
    try:
        assert eng.watch is not None and eng._children  # the processes this launch started
        schedulers = [p for p in eng._children if "scheduler" in " ".join(psutil.Process(p).cmdline()).lower()
                      or psutil.Process(p).name().startswith("sglang::sched")]
        victim = schedulers[0] if schedulers else eng._children[0]
        eng.add_requests([Request(request_id="long", prompt_token_ids=(1, 2, 3, 4),
                                  sampling=SamplingParams(max_new_tokens=400, ignore_eos=True))])
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"child process\(es\) \[.*{victim}.*\] died"):
            eng.run_to_completion(timeout=120)
        assert time.monotonic() - t0 < 60  # found by the dead-process check, not the 120 s timeout
    finally:
        eng.shutdown()
