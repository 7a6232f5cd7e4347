"""The engine reports what an import really did, so tests can prove migrated KV is used: a request
imported with its KV is never prefilled again; one whose blocks do not fit falls back to recomputation
and is reported as a fallback (it used to be silent)."""

from __future__ import annotations

from ref_helpers import make_engine, make_requests


def _exported(path: str, **overrides):
    engine = make_engine(path, block_size=4, **overrides)
    requests = make_requests([9, 13], [12, 12])
    engine.add_requests(requests)
    engine.step(5)
    states = engine.export_requests()
    kv = {s.request_id: engine.export_kv(s.request_id, engine.local_kv_heads()) for s in states}
    engine.free_exported()
    return engine, requests, states, kv


def _finish(engine) -> dict[str, tuple[int, ...]]:
    out = {}
    while engine.has_unfinished():
        out.update((o.request_id, o.token_ids) for o in engine.step(4).finished)
    return out


def test_migrated_kv_is_used_and_recompute_is_counted(tiny_models):
    path = tiny_models["llama"]
    reference = {o.request_id: o.token_ids for o in make_engine(path, block_size=4).generate(
        make_requests([9, 13], [12, 12]))}
    engine, requests, states, kv = _exported(path)
    prompts = sum(len(r.prompt_token_ids) for r in requests)
    assert engine.stats["prefill_tokens"] == prompts
    assert engine.import_requests(states, kv) == []
    assert _finish(engine) == reference
    assert engine.stats["prefill_tokens"] == prompts  # nothing recomputed
    assert engine.stats["imported_with_kv"] == 2 and engine.stats["import_fallbacks"] == 0
    assert engine.stats["kv_tokens_imported"] == sum(s.num_cached_tokens for s in states)

    engine, requests, states, _ = _exported(path)
    assert engine.import_requests(states) == []  # no KV given: recompute, not a fallback
    assert _finish(engine) == reference
    assert engine.stats["prefill_tokens"] == prompts + sum(s.num_tokens for s in states)  # context + last token
    assert engine.stats["imported_with_kv"] == 0 and engine.stats["import_fallbacks"] == 0


def test_import_without_free_blocks_reports_fallback(tiny_models):
    path = tiny_models["llama"]
    engine, _, states, kv = _exported(path, num_kv_blocks=16)
    hog = make_requests([60], [2], prefix="hog")  # 15 of the 16 blocks
    engine.add_requests(hog)
    engine.step(1)
    fallbacks = engine.import_requests(states, kv)
    assert fallbacks == [s.request_id for s in states]
    assert engine.stats["import_fallbacks"] == 2 and engine.stats["imported_with_kv"] == 0
