from __future__ import annotations

import json
import statistics

import pytest

from pat_rollout.sim import deepscaler_like, read_trace, uniform_trace, verl_like


def test_deepscaler_like_shape_and_seed() -> None:
    t = deepscaler_like(seed=0)
    st = t.stats()
    assert st["num_requests"] == 1024 and 4500 < st["mean"] < 6500 and st["max"] == 16384
    assert 0.03 < st["frac_at_cap"] < 0.15 and st["median"] < st["mean"]
    assert t == deepscaler_like(seed=0) and t != deepscaler_like(seed=1)
    assert {r.prompt_id for r in t.history} == {r.prompt_id for r in t.records}
    # per-prompt correlation: the 8 samples of a prompt are closer to each other than to the whole batch
    by: dict[str, list[int]] = {}
    for r in t.records:
        by.setdefault(r.prompt_id, []).append(r.response_len)
    within = statistics.fmean(statistics.pvariance(v) for v in by.values())
    assert within < 0.6 * statistics.pvariance([r.response_len for r in t.records])


def test_verl_like_shape() -> None:
    st = verl_like(seed=0).stats()
    assert 900 < st["mean"] < 1500 and 7000 < st["max"] and st["max"] / st["mean"] > 6


def test_uniform_trace() -> None:
    st = uniform_trace(num_requests=16, response_len=100).stats()
    assert st["mean"] == st["max"] == 100


def test_read_csv_and_jsonl(tmp_path) -> None:
    c = tmp_path / "t.csv"
    c.write_text("prompt_id,prompt_len,response_len,extra\na,10,5,x\nb,12,7,y\n")
    t = read_trace(c)
    assert [r.response_len for r in t.records] == [5, 7] and t.max_new_tokens == 7 and t.name == "t"
    j = tmp_path / "t.jsonl"
    j.write_text(json.dumps({"prompt_id": "a", "prompt_len": 10, "response_len": 5}) + "\n\n")
    assert read_trace(j, max_new_tokens=16).records[0].prompt_id == "a"


@pytest.mark.parametrize("name, text, match", [
    ("a.csv", "prompt_id,response_len\na,5\n", r"missing columns \['prompt_len'\]"),
    ("b.csv", "prompt_id,prompt_len,response_len\na,10,\n", r"b.csv:2: missing \['response_len'\]"),
    ("c.csv", "prompt_id,prompt_len,response_len\na,ten,5\n", "must be integers"),
    ("d.jsonl", '{"prompt_id": "a", "prompt_len": 3}\n', r"d.jsonl:1: missing \['response_len'\]"),
    ("e.jsonl", "[1, 2]\n", "expected a JSON object"),
    ("f.txt", "x", "unknown trace format"),
    ("g.csv", "", "empty CSV"),
])
def test_reader_errors(tmp_path, name: str, text: str, match: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(p)


def test_response_over_cap_rejected(tmp_path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("prompt_id,prompt_len,response_len\na,10,50\n")
    with pytest.raises(ValueError, match="max_new_tokens=16"):
        read_trace(p, max_new_tokens=16)
