"""Bad models, layouts, options and requests fail early with ValueErrors naming the operands."""

from __future__ import annotations

import json
import shutil

import pytest
from ref_helpers import make_engine, make_requests

from pat_rollout.comm.tp_context import TPContext
from pat_rollout.engine.ref import RefEngineConfig
from pat_rollout.types import Request, SamplingParams


def test_missing_path_and_files(tmp_path, tiny_models):
    with pytest.raises(ValueError, match="no config.json"):
        RefEngineConfig(model_path=str(tmp_path / "nope"))
    shutil.copy(f"{tiny_models['llama']}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        make_engine(str(tmp_path))


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported model: model_type='gpt2'"):
        make_engine(str(tmp_path))


@pytest.mark.parametrize("size, match", [(3, "tp_size=3 must divide num_heads=4"), (8, "tp_size=8 must divide")])
def test_bad_tp(tiny_models, size, match):
    with pytest.raises(ValueError, match=match):
        make_engine(tiny_models["llama"], TPContext(rank=0, size=size))


def test_tp_must_divide_max_tp(tiny_models):
    with pytest.raises(ValueError, match="must divide max_tp=1"):
        make_engine(tiny_models["llama"], TPContext(rank=0, size=2), max_tp=1)


@pytest.mark.parametrize("bad", [dict(dtype="float16"), dict(block_size=0), dict(num_kv_blocks=0)])
def test_bad_config(tiny_models, bad):
    with pytest.raises(ValueError):
        RefEngineConfig(model_path=tiny_models["llama"], **bad)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=0), dict(max_new_tokens=0)])
def test_bad_sampling(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_bad_requests(tiny_models):
    engine = make_engine(tiny_models["llama"])
    with pytest.raises(ValueError, match="outside vocab"):
        engine.add_requests([Request(request_id="x", prompt_token_ids=(5, 250))])
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        engine.add_requests([Request(request_id="x", prompt_token_ids=(5,) * 500,
                                     sampling=SamplingParams(max_new_tokens=20))])
    with pytest.raises(ValueError, match="repeated"):
        engine.add_requests(make_requests([3, 4], [2, 2]) + make_requests([3], [2]))
    assert not engine.has_unfinished()
