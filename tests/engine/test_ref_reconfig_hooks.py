"""PAT hooks: export/import (with KV = migration, without = recompute), set_layout, weights, release."""

from __future__ import annotations

import pytest
import torch
from ref_helpers import make_engine, make_requests

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.ref.loader import iter_safetensors

LENGTHS, MAX_NEW = [3, 14, 7, 22, 9], [12, 9, 16, 11, 14]


def _requests():
    # A sampled request checks that the (seed, position) noise survives the move.
    return make_requests(LENGTHS, MAX_NEW) + make_requests([6], [15], prefix="s", temperature=0.9, top_p=0.9, seed=4)


def _run(engine, finished=None):
    finished = dict(finished or {})
    while engine.has_unfinished():
        finished.update((o.request_id, (o.token_ids, o.log_probs)) for o in engine.step(4).finished)
    return finished


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch_and_reference(request, tiny_models):
    engine = make_engine(tiny_models[request.param], block_size=4)
    return request.param, {o.request_id: (o.token_ids, o.log_probs) for o in engine.generate(_requests())}


def _assert_same(got, expected):
    assert sorted(got) == sorted(expected)
    for rid, (tokens, log_probs) in expected.items():
        assert got[rid][0] == tokens, rid
        assert got[rid][1] == pytest.approx(log_probs, abs=1e-9), rid


@pytest.mark.parametrize("mode", ["kv_same_engine", "kv_new_engine", "recompute", "subset"])
def test_export_import_continues_exactly(tiny_models, arch_and_reference, mode):
    arch, reference = arch_and_reference
    # max_num_seqs=4 leaves requests waiting at export time (num_cached_tokens == 0).
    src = make_engine(tiny_models[arch], block_size=4, max_num_seqs=4)
    src.add_requests(_requests())
    finished = {o.request_id: (o.token_ids, o.log_probs) for o in src.step(6).finished}
    ids = ["r1", "r3", "s0"] if mode == "subset" else None
    states = src.export_requests(ids)
    assert {s.request_id for s in states} == set(ids or [*reference]) - set(finished)
    assert any(s.num_cached_tokens == 0 for s in states) or mode == "subset"
    lo, hi = src.local_kv_heads()
    kv = {s.request_id: src.export_kv(s.request_id, (lo, hi)) for s in states} if mode != "recompute" else None
    for s in states:
        if kv:
            assert kv[s.request_id].shape == (2, 2, s.num_cached_tokens, 2, 16)
    src.free_exported()
    dst = make_engine(tiny_models[arch], block_size=8) if mode == "kv_new_engine" else src
    dst.import_requests(states, kv)
    finished = _run(dst, finished)
    if mode == "subset":
        finished.update(_run(src))
    _assert_same(finished, reference)


def test_export_kv_errors(tiny_models):
    engine = make_engine(tiny_models["llama"])
    engine.add_requests(make_requests([5], [8]))
    engine.step(2)
    with pytest.raises(ValueError, match="not exported"):
        engine.export_kv("r0", (0, 2))
    with pytest.raises(ValueError, match=r"not running or waiting"):
        engine.export_requests(["nope"])
    (state,) = engine.export_requests()
    with pytest.raises(ValueError, match=r"holds KV heads \[0, 2\), not \[1, 3\)"):
        engine.export_kv("r0", (1, 3))
    with pytest.raises(RuntimeError, match="exported=1"):
        engine.set_layout(TPContext())
    kv = engine.export_kv("r0", (0, 2))
    engine.free_exported()
    with pytest.raises(ValueError, match="expected"):
        engine.import_requests([state], {"r0": kv[:, :, :, :1]})
    with pytest.raises(ValueError, match="not being imported"):
        engine.import_requests([state], {"other": kv})
    engine.import_requests([state], {"r0": kv})
    with pytest.raises(ValueError, match="already in the engine"):
        engine.import_requests([state])


def test_set_layout_checks(tiny_models):
    engine = make_engine(tiny_models["llama"])
    shards = engine.named_shards()
    assert set(shards) == set(engine.shard_specs)
    for name, t in shards.items():
        assert tuple(t.shape) == engine.shard_specs[name].local_shape(0, 1)
    engine.add_requests(make_requests([4], [5]))
    engine.step(1)
    with pytest.raises(RuntimeError, match="running=1 waiting=0 exported=0"):
        engine.set_layout(TPContext())
    engine.abort_all()
    bad = {**shards, "model.norm.weight": torch.ones(3, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"model.norm.weight is \(3,\)"):
        engine.set_layout(TPContext(), bad)
    with pytest.raises(ValueError, match="missing"):
        engine.set_layout(TPContext(), {k: v for k, v in shards.items() if "norm" not in k})
    with pytest.raises(ValueError, match="tp_size=3 must divide num_heads=4"):
        engine.set_layout(TPContext(rank=0, size=3))
    # Same layout, fresh tensors: swapped in and used.
    engine.set_layout(TPContext(), {k: v.clone() for k, v in shards.items()})
    assert engine.generate(make_requests([4], [5], prefix="z"))[0].finish_reason in ("length", "stop")


def test_update_weights_release_resume_abort(tiny_models):
    path = tiny_models["qwen3"]
    engine = make_engine(path)
    requests = make_requests([5, 9], [10, 10])
    expected = [o.token_ids for o in engine.generate(requests)]
    engine.update_weights((n, torch.zeros_like(t)) for n, t in iter_safetensors(path) if "mlp" in n)
    assert [o.token_ids for o in engine.generate(make_requests([5, 9], [10, 10], prefix="z"))] != expected
    engine.release(["kv_cache", "weights"])
    engine.reload_weights()
    engine.add_requests(requests)
    with pytest.raises(RuntimeError, match="released"):
        engine.step()
    engine.resume(["kv_cache"])
    engine.step(3)
    with pytest.raises(RuntimeError, match="running=2"):
        engine.release(["kv_cache"])
    with pytest.raises(ValueError, match="unknown release/resume tags"):
        engine.release(["gpu"])
    aborted = engine.abort_all()
    assert [o.finish_reason for o in aborted] == ["abort", "abort"]
    assert [o.token_ids for o in aborted] == [t[:3] for t in expected]
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks
    assert [o.token_ids for o in engine.generate(make_requests([5, 9], [10, 10], prefix="y"))] == expected
