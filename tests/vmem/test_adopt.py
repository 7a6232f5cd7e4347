"""`vmem.adopt` on the CPU with a `HostMapper`: a model's parameters and a KV storage are copied into reserved
ranges and re-pointed (same Parameter objects, outputs bit-exact), a grow really moves the weight tails' pages into
the KV range (bytes arrive, the weight addresses fault: checked in a subprocess), and a shrink brings them home."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

if not sys.platform.startswith("linux"):
    pytest.skip("HostMapper is Linux only", allow_module_level=True)

from pat_rollout.vmem import KvRegion, ReclaimPlan, WeightStorage, apply_switch  # noqa: E402
from pat_rollout.vmem.adopt import adopt  # noqa: E402
from pat_rollout.vmem.host import HostMapper, torch_bytes  # noqa: E402
from pat_rollout.vmem.plan import align_up  # noqa: E402

G = 4096


def _setup(m: HostMapper):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    kv_old = torch.arange(3000, dtype=torch.float32)
    params = [p for p in model.parameters()]
    weights = [WeightStorage(name=str(i), start=m.reserve(align_up(p.untyped_storage().nbytes(), G)),
                             nbytes=p.untyped_storage().nbytes(),
                             kept={1: p.untyped_storage().nbytes(), 2: p.untyped_storage().nbytes() // 2})
               for i, p in enumerate(params)]
    base = align_up(kv_old.untyped_storage().nbytes(), G)
    kv = [KvRegion(start=m.reserve(base + 8 * G), base_bytes=base, reserved_bytes=base + 8 * G)]
    plan = ReclaimPlan.build(weights=weights, kv=kv, tps=(1, 2), granule=G)
    return model, params, kv_old, plan


def test_adopted_parameters_keep_their_objects_and_outputs_and_pages_really_move():
    m = HostMapper(G)
    try:
        model, params, kv_old, plan = _setup(m)
        x = torch.randn(5, 64)
        before = model(x).detach().clone()
        snap = [p.detach().clone() for p in params]
        ids = [id(p) for p in params]
        held = {}
        kv_list = [kv_old.untyped_storage()]
        handles = adopt(plan, m, torch_bytes, [[p] for p in params], kv_list,
                        lambda j, old, new: held.update({j: new}))
        assert [id(p) for p in model.parameters()] == ids and kv_list == [None]
        for p, w in zip(params, plan.weights):
            assert w.start <= p.data_ptr() < w.start + align_up(w.nbytes, G)
        kv = torch.empty(0).set_(held[0], 0, (3000,))
        assert kv.data_ptr() == plan.kv[0].start and torch.equal(kv, torch.arange(3000, dtype=torch.float32))
        assert torch.equal(model(x), before)  # bit-exact through the mapped memory
        assert m.physical_bytes() == len(handles) * G + plan.kv[0].base_bytes
        assert m.resident_bytes() <= m.physical_bytes()

        # "reshard" to TP2: each parameter keeps its first half; then the tails' pages go to the KV range
        lent = plan.lent_pages(2)
        assert lent > 0
        tail_bytes = {va: torch_bytes(va, G).clone() for va in plan.order[:lent]}
        apply_switch(plan, m, handles, 1, 2, kv_used_bytes=[0])
        r = plan.kv[0]
        assert m.mapped_in(r.start, r.reserved_bytes) == r.base_bytes + lent * G
        for i, va in enumerate(plan.order[:lent]):
            assert torch.equal(torch_bytes(plan.kv_slot(i), G), tail_bytes[va])  # the same physical page
        torch_bytes(plan.kv_slot(0), G).fill_(7)  # KV writes into a lent page
        apply_switch(plan, m, handles, 2, 1, kv_used_bytes=[0])
        assert m.mapped_in(r.start, r.reserved_bytes) == r.base_bytes
        assert torch.equal(torch_bytes(plan.order[0], G), torch.full((G,), 7, dtype=torch.uint8))  # home again
        torch_bytes(plan.order[0], G).copy_(tail_bytes[plan.order[0]])  # undo that write: all else came home
        assert torch.equal(model(x), before)
        assert all(torch.equal(p, s) for p, s in zip(params, snap))
    finally:
        m.close()


def test_a_lent_weight_page_faults_at_its_weight_address():
    code = textwrap.dedent("""
        import torch
        from pat_rollout.vmem import KvRegion, ReclaimPlan, WeightStorage, apply_switch
        from pat_rollout.vmem.adopt import adopt
        from pat_rollout.vmem.host import HostMapper, torch_bytes
        G = 4096
        m = HostMapper(G)
        p = torch.nn.Parameter(torch.ones(2048))  # 2 pages
        plan = ReclaimPlan.build(weights=[WeightStorage(name="p", start=m.reserve(2 * G), nbytes=2 * G,
                                                        kept={1: 2 * G, 2: G})],
                                 kv=[KvRegion(start=m.reserve(2 * G), base_bytes=G, reserved_bytes=2 * G)],
                                 tps=(1, 2), granule=G)
        h = adopt(plan, m, torch_bytes, [[p]], [torch.zeros(1024).untyped_storage()], lambda *a: None)
        apply_switch(plan, m, h, 1, 2, kv_used_bytes=[0])
        print("head", float(p[:1024].sum()), flush=True)  # the kept head reads
        print("tail", float(p[1024:].sum()), flush=True)  # the lent page: SIGSEGV
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["head 1024.0"], out.stderr[-2000:]
    assert out.returncode == -11, (out.returncode, out.stderr[-2000:])  # SIGSEGV: the page is not there
