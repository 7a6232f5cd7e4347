"""Convert verl's rollout config into a `PatRolloutConfig`, once, at the boundary.

PAT options live in `actor_rollout_ref.rollout.engine_kwargs.pat` and/or `actor_rollout_ref.rollout.custom.pat`
(a literal `rollout.pat` section is impossible: verl builds RolloutConfig through `_target_`). Derived fields:

- num_devices  = tensor_model_parallel_size * data_parallel_size: one verl replica is one PAT pool
- dtype        = rollout.dtype, max_num_seqs = rollout.max_num_seqs, seed = rollout.seed (each overridable)
- model_path   = the local model path verl resolved
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pat_rollout.config import PatRolloutConfig
from pat_rollout.types import ModelSpec

ENGINE_KWARGS_KEY = "actor_rollout_ref.rollout.engine_kwargs.pat"
CUSTOM_KEY = "actor_rollout_ref.rollout.custom.pat"
# Fields of PatRolloutConfig a user may set. model_path always comes from actor_rollout_ref.model.
ALLOWED_KEYS = tuple(f.name for f in dataclasses.fields(PatRolloutConfig) if f.name != "model_path")


def _to_dict(obj: Any, where: str) -> dict[str, Any]:
    if obj is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(obj, DictConfig):
            obj = OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with hydra-core
        pass
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where} must be a mapping of PAT options, got {type(obj).__name__}: {obj!r}")
    return dict(obj)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def pat_options(rollout_cfg: Any) -> dict[str, Any]:
    """The user's PAT options, merged from engine_kwargs.pat and custom.pat; ValueError on unknown keys
    or on a key set to different values in the two places."""
    from_engine = _to_dict((_get(rollout_cfg, "engine_kwargs") or {}).get("pat"), ENGINE_KWARGS_KEY)
    from_custom = _to_dict((_get(rollout_cfg, "custom") or {}).get("pat"), CUSTOM_KEY)
    for where, opts in ((ENGINE_KWARGS_KEY, from_engine), (CUSTOM_KEY, from_custom)):
        unknown = sorted(set(opts) - set(ALLOWED_KEYS))
        if unknown:
            raise ValueError(f"unknown PAT option(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                             f"allowed keys: {', '.join(ALLOWED_KEYS)}")
    for key in sorted(set(from_engine) & set(from_custom)):
        if from_engine[key] != from_custom[key]:
            raise ValueError(f"inconsistent PAT option {key!r}: {ENGINE_KWARGS_KEY}.{key}={from_engine[key]!r} but "
                             f"{CUSTOM_KEY}.{key}={from_custom[key]!r}; set it in one place")
    return {**from_custom, **from_engine}


def from_verl(rollout_cfg: Any, model_path: str | None = None, *, check_model: bool = True) -> PatRolloutConfig:
    """Build the PAT pool config of one verl replica from verl's RolloutConfig (dataclass or DictConfig).

    Raises ValueError naming the offending key for unknown, inconsistent or invalid options, including TP
    sizes that do not divide the pool or (when `check_model` and `model_path/config.json` exists) the
    model's attention heads.
    """
    opts = pat_options(rollout_cfg)
    tp = int(_get(rollout_cfg, "tensor_model_parallel_size", 1))
    dp = int(_get(rollout_cfg, "data_parallel_size", 1))
    pp = int(_get(rollout_cfg, "pipeline_model_parallel_size", 1))
    if pp != 1:
        raise ValueError(f"actor_rollout_ref.rollout.pipeline_model_parallel_size={pp}: PAT supports only 1")
    pool = tp * dp
    if "num_devices" in opts and int(opts["num_devices"]) != pool:
        raise ValueError(
            f"inconsistent PAT option num_devices={opts['num_devices']}: one PAT pool is one verl replica of "
            f"tensor_model_parallel_size * data_parallel_size = {tp} * {dp} = {pool} devices; drop num_devices "
            "or change the verl sizes")
    if model_path is None:
        raise ValueError("from_verl needs model_path (actor_rollout_ref.model.path)")
    kwargs: dict[str, Any] = {
        "model_path": str(model_path),
        "num_devices": pool,
        "dtype": str(_get(rollout_cfg, "dtype", "bfloat16")),
        "max_num_seqs": int(_get(rollout_cfg, "max_num_seqs", 256)),
        "seed": int(_get(rollout_cfg, "seed", 0)),
        **opts,
    }
    if "candidate_tps" in kwargs:
        tps = kwargs["candidate_tps"]
        if isinstance(tps, int):
            tps = (tps,)
        kwargs["candidate_tps"] = tuple(int(t) for t in tps)
    if "planner" in kwargs:
        kwargs["planner"] = _to_dict(kwargs["planner"], f"{ENGINE_KWARGS_KEY}.planner")
    if "engine_args" in kwargs:
        kwargs["engine_args"] = _to_dict(kwargs["engine_args"], f"{ENGINE_KWARGS_KEY}.engine_args")
    if kwargs.get("backend") == "sglang":  # verl's memory settings, as its own SGLang rollout passes them
        kwargs["engine_args"] = {"mem_fraction_static": float(_get(rollout_cfg, "gpu_memory_utilization", 0.5)),
                                 "enable_memory_saver": bool(_get(rollout_cfg, "free_cache_engine", True)),
                                 **kwargs.get("engine_args", {})}
    try:
        cfg = PatRolloutConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid PAT options {opts} for a pool of num_devices={pool} "
                         f"(tensor_model_parallel_size={tp} * data_parallel_size={dp}): {e}") from e
    config_json = Path(model_path) / "config.json"
    if check_model and config_json.exists():
        spec = ModelSpec.from_hf_config(json.loads(config_json.read_text()))
        for t in cfg.tp_sizes:
            try:
                spec.check_tp(t)
            except ValueError as e:
                raise ValueError(f"PAT TP size {t} (from initial_tp/candidate_tps {cfg.tp_sizes}) does not fit "
                                 f"the model at {model_path}: {e}") from e
    return cfg
