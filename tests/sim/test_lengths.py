from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pat_rollout.sim.__main__ import main
from pat_rollout.sim.lengths import LengthsOptions, read_lengths, synth_lengths

DATA = Path(__file__).resolve().parents[2] / "pat_rollout" / "sim" / "data"


def test_csv_rows_with_steps_become_stages_with_history(tmp_path: Path) -> None:
    p = tmp_path / "l.csv"
    p.write_text("step,prompt_id,prompt_len,response_len\n0,a,10,5\n0,a,10,7\n1,a,10,9\n1,b,12,20\n")
    t0, t1 = read_lengths(p)
    assert [r.response_len for r in t1.records] == [9, 20] and t1.max_new_tokens == 20
    assert [(r.prompt_id, r.response_len) for r in t1.history] == [("a", 5), ("a", 7)]
    assert t0.history == () and t1.records[1].prompt_len == 12


def test_jsonl_rows_and_lists(tmp_path: Path) -> None:
    p = tmp_path / "l.jsonl"
    p.write_text('{"response_length": 30}\n{"response_length": 50, "prompt_len": 7}\n\n')
    (t,) = read_lengths(p, LengthsOptions(prompt_len=99, samples_per_prompt=2))
    assert [(r.prompt_id, r.prompt_len, r.response_len) for r in t.records] == [("p0", 99, 30), ("p0", 7, 50)]
    q = tmp_path / "s.jsonl"
    q.write_text(json.dumps({"step": 3, "response_lengths": [1, 2, 3, 4]}) + "\n")
    (t,) = read_lengths(q, LengthsOptions(samples_per_prompt=2, max_new_tokens=3))
    assert [r.response_len for r in t.records] == [1, 2, 3, 3] and t.name.endswith("@step3")
    assert [r.prompt_id for r in t.records] == ["p0", "p0", "p1", "p1"]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("prompt_id,tokens\na,3\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: no response length: expected one of \['response_len'"):
        read_lengths(p)
    q = tmp_path / "bad.jsonl"
    q.write_text('{"response_len": "many"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: response_len='many' is not a number"):
        read_lengths(q)
    with pytest.raises(ValueError, match="unknown format '.txt'"):
        (tmp_path / "x.txt").write_text("1\n")
        read_lengths(tmp_path / "x.txt")


def test_wandb_export_statistics_are_reproduced() -> None:
    traces = read_lengths(DATA / "example_wandb_export.csv", LengthsOptions(max_new_tokens=16384, num_requests=1024))
    assert [t.name.split("@")[1] for t in traces] == ["step10", "step11", "step12"]
    t = traces[-1]  # step 12: mean 1302, max 12012, min 101, clip_ratio 0.008, prompt 212
    lens = [r.response_len for r in t.records]
    assert len(lens) == 1024 and min(lens) >= 101 and all(r.prompt_len == 212 for r in t.records)
    assert sum(x == 16384 for x in lens) == round(0.008 * 1024)
    free = synth_lengths(1302, 12012, 1024, 10**6)  # no cap, no clipping: the fitted lognormal itself
    assert statistics.fmean(free) == pytest.approx(1302, rel=0.03) and max(free) == pytest.approx(12012, rel=0.1)
    assert len({r.prompt_id for r in t.records}) == 128  # GRPO groups of 8


def test_cli_on_shipped_example(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--lengths", str(DATA / "example_lengths.csv"), "--variants", "central", "--no-oracle",
          "--num-devices", "4", "--stages", "2", "--jobs", "1"])
    cap = capsys.readouterr()
    out = cap.out
    assert "trace example_lengths@step1: 512 responses" in out
    for policy in ("static-tp1", "static-tp2", "static-tp4", "pat"):
        assert f"\n{policy} " in out
    assert "SIMULATED" in out and "first: PAT vs best static" in out and "steady: PAT vs best static" in out
    assert "KV tokens per replica, stock engine (statics): TP1 " in out and "PAT's pool (PAT, oracle): TP1 " in out
    assert "first_s" in out and "steady_s" in out
    assert "[central] [" in cap.err and "5/5 pat stage 2/2" in cap.err  # the progress bar: 3 statics + 2 stages
