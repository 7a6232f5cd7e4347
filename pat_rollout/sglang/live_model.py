"""The live SGLang model inside a scheduler process: its parameters' shard specs under SGLang's names
(`sglang_specs`), its HF config, and its rebuild for the TP of the current runtime context
(`rebuild_model_for_current_tp`). Shared by `scheduler_hooks` (pat_save_params) and `pool_switch` (the switch),
so neither imports the other for it. Only stdlib, torch and pat_rollout at import time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pat_rollout.layout.shard import Partition, ShardSpec, model_shard_specs
from pat_rollout.types import ModelSpec

VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


def sglang_specs(hf_config: dict[str, Any], padded_vocab: int) -> dict[str, ShardSpec]:
    """pat_rollout shard specs with SGLang's names and SGLang's vocab padding (`pad_vocab_size(v, 64)`,
    not pat_rollout's `padded_vocab_size(v, max_tp)`), so they describe SGLang's params exactly."""
    spec = ModelSpec.from_hf_config(hf_config)
    specs = model_shard_specs(spec, max_tp=1)
    for name in VOCAB_PARAMS:
        if name in specs:
            s = specs[name]
            specs[name] = replace(s, shape=(padded_vocab,) + s.shape[1:],
                                  partitions=(Partition(num_units=padded_vocab, unit_size=1),))
    return specs


def _model(self) -> torch.nn.Module:
    return self.tp_worker.model_runner.model


def _hf_config_dict(self) -> dict[str, Any]:
    return self.tp_worker.model_runner.model_config.hf_config.to_dict()


def _padded_vocab(self) -> int:
    emb = _model(self).model.embed_tokens
    return int(emb.num_embeddings_padded)


def _bind(new: torch.nn.Module, slot: str, sources: dict[str, torch.Tensor], targets) -> None:
    """Put each `sources[name]` into `new` in place of its same-named meta tensor (`slot`: _parameters or _buffers),
    refusing any shape that differs from what SGLang's constructor made for the current TP."""
    for name, t in list(targets):
        src = sources[name]
        if tuple(src.shape) != tuple(t.shape):
            raise RuntimeError(f"{name}: resharded shape {tuple(src.shape)} != new module's {tuple(t.shape)}")
        mod, _, leaf = name.rpartition(".")
        getattr(new.get_submodule(mod), slot)[leaf] = src


def rebuild_model_for_current_tp(old: torch.nn.Module, params: dict[str, torch.Tensor] | None = None
                                 ) -> torch.nn.Module:
    """A new module tree of `type(old)` built for the TP in the current runtime context (on the meta device,
    no weight memory), with `old`'s Parameter objects (already resharded in place) and buffers bound into it;
    tensors in `params` (new shards that could not be resharded in place, or a backup) replace them by name.
    Module attributes fixed at construction (heads per rank, q/kv sizes, partition sizes, vocab shard
    indices, logits gather flag, group handles) thereby come from SGLang's own constructors."""
    with torch.device("meta"):
        new = type(old)(config=old.config, quant_config=getattr(old, "quant_config", None))
    old_params = dict(old.named_parameters())
    for name, t in (params or {}).items():
        old_params[name] = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
    _bind(new, "_parameters", old_params, new.named_parameters())
    _bind(new, "_buffers", dict(old.named_buffers()), new.named_buffers())
    # Attributes SGLang's loader sets on modules after construction (e.g. `shared_experts_config`).
    new_mods = dict(new.named_modules())
    for mname, omod in old.named_modules():
        nmod = new_mods.get(mname)
        if nmod is not None:
            for k, v in omod.__dict__.items():
                if k not in nmod.__dict__:
                    nmod.__dict__[k] = v
    leftover = [n for n, t in list(new.named_parameters()) + list(new.named_buffers()) if t.is_meta]
    if leftover:
        raise RuntimeError(f"tensors left on meta after rebinding: {leftover[:5]}")
    return new
