"""How rank 0 routes what it read to the replica leaders (`replica_input.route`), with SGLang's own request types.

Generate requests go to the leader of the replica their rid names (a batch is split across replicas), everything
else to every leader in the order read, and nothing after an RPC is routed in the same iteration (a switch changes
who leads). No engine: the request objects are built directly.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt")

from pat_rollout.sglang.replica_input import make_rid, replica_of_rid, route  # noqa: E402

pytestmark = pytest.mark.sglang

TWO_TP1 = ((0,), (1,))
TWO_TP2 = ((0, 1), (2, 3))


def _request(cls, **fields):
    """An SGLang request object with only `fields` set (0.5.23: a msgspec Struct, the other required fields None;
    0.5.12: a dataclass built without __init__)."""
    try:
        import msgspec

        rest = {f.name: None for f in msgspec.structs.fields(cls) if f.required and f.name not in fields}
        return cls(**rest, **fields)
    except (ImportError, TypeError):
        req = cls.__new__(cls)
        for k, v in fields.items():
            setattr(req, k, v)
        return req


def _generate(rid: str):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    return _request(TokenizedGenerateReqInput, rid=rid)


def _batch(reqs):
    from sglang.srt.managers.io_struct import BatchTokenizedGenerateReqInput

    return _request(BatchTokenizedGenerateReqInput, batch=reqs)


def _same(shares, expected) -> bool:
    """The very objects, in order (0.5.12's request dataclasses built without __init__ cannot be compared)."""
    return {k: [id(r) for r in v] for k, v in shares.items()} == {k: [id(r) for r in v] for k, v in expected.items()}


def test_rids_name_their_replica():
    assert replica_of_rid(make_rid(3, "abc-def")) == 3
    assert replica_of_rid("not-a-pool-rid") is None and replica_of_rid("pat-rx-1") is None


def test_generate_to_its_leader_control_to_every_leader_in_order():
    from sglang.srt.managers.io_struct import AbortReq

    g0, g1, g1b = _generate(make_rid(0, "a")), _generate(make_rid(1, "b")), _generate(make_rid(1, "c"))
    abort = AbortReq(rid=make_rid(1, "b"))
    shares, held = route([g1, abort, g0, _batch([g1b, g0])], TWO_TP2)
    assert held == []
    assert _same(shares, {0: [abort, g0, g0], 2: [g1, abort, g1b]})  # leaders are ranks 0 and 2


def test_nothing_after_an_rpc_is_routed_in_the_same_iteration():
    from sglang.srt.managers.io_struct import RpcReqInput

    rpc = RpcReqInput(method="pat_switch", parameters={})
    g0, g1 = _generate(make_rid(0, "a")), _generate(make_rid(1, "b"))
    shares, held = route([g0, rpc, g1], TWO_TP1)
    assert _same(shares, {0: [g0, rpc], 1: [rpc]}) and _same({0: held}, {0: [g1]})


def test_a_rid_naming_a_replica_the_layout_lacks_is_an_error():
    with pytest.raises(RuntimeError, match=r"request 'pat-r2-x' names replica 2, but the layout has 2"):
        route([_generate(make_rid(2, "x"))], TWO_TP1)
