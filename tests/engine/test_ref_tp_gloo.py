"""TP=2 and TP=4 (KV heads replicated) over real gloo process groups give TP=1's tokens.

One spawn of 4 processes covers: TP=4 on the world group, TP=2 on groups {0,1} and {2,3} (in
group-rank order and reversed, via TPContext.global_ranks), set_layout TP=4 -> TP=2 with shards
loaded for TP=2, a mid-decode export at TP=4 resumed (recompute) at TP=2, then back to TP=4
reloading shards -- for Llama and Qwen3 (tied embeddings).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ref_helpers import make_engine, make_requests

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.ref.loader import load_shards

WORLD = 4
ARCHS = ("llama", "qwen3")


def _requests():
    sampled = make_requests([7], [12], prompt_seed=9, prefix="s", temperature=1.0, top_k=40, seed=3)
    return make_requests([3, 9, 26, 14], [10, 14, 6, 12], prompt_seed=5) + sampled


def _outputs(outs):
    return {o.request_id: (o.token_ids, o.log_probs) for o in outs}


def _worker(rank: int, init_file: str, paths: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    tp4 = TPContext.from_group(dist.group.WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, same order
    tp2 = TPContext(rank=rank % 2, size=2, group=pairs[rank // 2])
    # Same groups, TP order opposite to group-rank order: TP rank 0 lives on the odd global rank.
    mates = (rank // 2 * 2 + 1, rank // 2 * 2)
    tp2_swapped = TPContext(rank=mates.index(rank), size=2, group=pairs[rank // 2], global_ranks=mates)
    results = {}
    for arch in ARCHS:
        results[arch, "tp2"] = _outputs(make_engine(paths[arch], tp2, block_size=4).generate(_requests()))
        swapped = make_engine(paths[arch], tp2_swapped, block_size=4)
        results[arch, "tp2 swapped order"] = _outputs(swapped.generate(_requests()))
        engine = make_engine(paths[arch], tp4, block_size=4)
        results[arch, "tp4"] = _outputs(engine.generate(_requests()))
        assert engine.local_kv_heads() == (rank // 2, rank // 2 + 1)  # 2 KV heads replicated over 4 ranks
        engine.add_requests(_requests())
        engine.step(4)
        states = engine.export_requests()
        engine.free_exported()
        engine.set_layout(tp2, load_shards(paths[arch], engine.shard_specs, tp2.rank, 2, engine.dtype))
        engine.import_requests(states)
        finished = {}
        while engine.has_unfinished():
            finished.update(_outputs(engine.step(8).finished))
        results[arch, "tp4->tp2 mid-decode"] = finished
        engine.set_layout(tp4)  # shapes do not fit TP=4: shards are reloaded from the checkpoint
        results[arch, "tp2->tp4 reload"] = _outputs(engine.generate(_requests()))
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_tp4_gloo_match_tp1(tiny_models, tmp_path):
    paths = {a: tiny_models[a] for a in ARCHS}
    mp.spawn(_worker, args=(str(tmp_path / "init"), paths, str(tmp_path)), nprocs=WORLD, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for arch in ARCHS:
        reference = _outputs(make_engine(paths[arch], block_size=4).generate(_requests()))
        for key in ("tp2", "tp2 swapped order", "tp4", "tp4->tp2 mid-decode", "tp2->tp4 reload"):
            for rank, results in enumerate(per_rank):
                got = results[arch, key]
                assert sorted(got) == sorted(reference), (arch, key, rank)
                for rid, (tokens, log_probs) in reference.items():
                    assert got[rid][0] == tokens, (arch, key, rank, rid)
                    assert got[rid][1] == pytest.approx(log_probs, abs=1e-9), (arch, key, rank, rid)
