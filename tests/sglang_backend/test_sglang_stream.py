"""The driver side of SGLang's token stream (`engine._Tracked.add_chunk`), without SGLang: the work per chunk is
bounded by the chunk's new tokens, and the tokens, log-probs and finish reason are exactly the streamed ones.

Chunks are built as SGLang's tokenizer manager builds them for a `skip_tokenizer_init` engine (0.5.23 and 0.5.12,
`_handle_batch_output` / `_handle_abort_req`); every list involved is a `CountingList` that counts the elements
read or copied out of it, so an O(L^2) consumer (one that re-reads or re-copies the output on every chunk) fails.
"""

from __future__ import annotations

import random

import pytest

from pat_rollout.sglang.engine import _Tracked
from pat_rollout.types import SamplingParams

NUM_TOKENS = 3000


class CountingList(list):
    """A list that adds to `reads[0]` every element iterated, indexed, sliced, copied or concatenated out of it."""

    def __init__(self, items=(), reads=None):
        super().__init__(items)
        self.reads = reads if reads is not None else [0]

    def __iter__(self):
        self.reads[0] += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        out = super().__getitem__(i)
        self.reads[0] += len(out) if isinstance(i, slice) else 1
        return out

    def copy(self):
        self.reads[0] += len(self)
        return super().copy()

    def __add__(self, other):
        self.reads[0] += len(self)
        return super().__add__(other)

    def __reversed__(self):
        self.reads[0] += len(self)
        return super().__reversed__()


def _stream(num_tokens: int, incremental: bool, reads: list[int], seed: int = 0) -> list[dict]:
    """SGLang's chunks for one request decoding `num_tokens` tokens in runs of 1-4 tokens per chunk (a chunk may
    coalesce several decode steps), then finishing by length."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 1000) for _ in range(num_tokens)]
    lps = [(-rng.random(), tid, None) for tid in ids]
    chunks, done = [], 0
    while done < num_tokens:
        lo, done = done, min(num_tokens, done + rng.randint(1, 4))
        lo_out = lo if incremental else 0
        meta = {"completion_tokens": done, "output_token_logprobs": CountingList(lps[lo_out:done], reads),
                "finish_reason": {"type": "length", "length": num_tokens} if done == num_tokens else None}
        chunks.append({"output_ids": CountingList(ids[lo_out:done], reads), "meta_info": meta})
    return chunks


def _tracked(reads: list[int]) -> _Tracked:
    t = _Tracked(request_id="r0", prompt=(1, 2, 3), sampling=SamplingParams(max_new_tokens=NUM_TOKENS), rid="0-x")
    t.new_ids, t.new_log_probs = CountingList((), reads), CountingList((), reads)
    return t


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "cumulative"])
def test_chunk_work_is_bounded_by_new_tokens(incremental):
    """Each token id and log-prob is read once from the chunks and never re-read from the request's own lists
    while streaming: 2 reads per token in all (a consumer copying the output per chunk reads O(L^2): millions here)."""
    chunk_reads, own_reads = [0], [0]
    chunks = _stream(NUM_TOKENS, incremental, chunk_reads)
    t = _tracked(own_reads)
    new_ids, new_log_probs = t.new_ids, t.new_log_probs
    for c in chunks:
        t.add_chunk(c)
        assert t.num_output_tokens == c["meta_info"]["completion_tokens"]
    assert chunk_reads[0] == 2 * NUM_TOKENS
    assert own_reads[0] == 0
    assert t.new_ids is new_ids and t.new_log_probs is new_log_probs  # extended in place, never rebuilt
    ids = [i for c in chunks[-1:] for i in c["output_ids"]] if not incremental else \
        [i for c in chunks for i in c["output_ids"]]
    lps = [x for c in (chunks[-1:] if not incremental else chunks) for x in c["meta_info"]["output_token_logprobs"]]
    out = t.to_output()
    assert out.token_ids == tuple(ids) and out.log_probs == tuple(lp for lp, _tid, _text in lps)
    assert out.finish_reason == "length" and len(out.token_ids) == NUM_TOKENS


def test_carried_tokens_and_abort_echo():
    """A resubmitted request (recompute path) keeps its carried tokens in front; SGLang's abort echo for a
    request aborted outside a batch re-sends its last token beside the whole log-prob list: nothing new."""
    t = _Tracked(request_id="r1", prompt=(1, 2), sampling=SamplingParams(max_new_tokens=8), rid="1-y",
                 carried_ids=(7, 8), carried_log_probs=(-0.5, -0.25))
    t.add_chunk({"output_ids": [11, 12], "meta_info": {"completion_tokens": 2, "finish_reason": None,
                                                       "output_token_logprobs": [(-1.0, 11, None), (-2.0, 12, None)]}})
    assert t.num_output_tokens == 4 and t.finish_reason is None
    t.add_chunk({"output_ids": [12], "meta_info": {"completion_tokens": 2, "finish_reason": {"type": "abort"},
                                                   "output_token_logprobs": [(-1.0, 11, None), (-2.0, 12, None)]}})
    assert t.output_ids == (7, 8, 11, 12) and t.output_log_probs == (-0.5, -0.25, -1.0, -2.0)
    assert t.finish_reason == "abort"


def test_inconsistent_chunk_names_the_request():
    t = _Tracked(request_id="r2", prompt=(1,), sampling=SamplingParams(max_new_tokens=8), rid="0-z")
    with pytest.raises(RuntimeError, match=r"'r2' \(rid 0-z\).*1 token ids and 1 log-probs says completion_tokens=3"):
        t.add_chunk({"output_ids": [5], "meta_info": {"completion_tokens": 3, "finish_reason": None,
                                                      "output_token_logprobs": [(-1.0, 5, None)]}})
