"""SamplingParams rejects values that would silently produce wrong output, naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pat_rollout.types import SamplingParams


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": math.nan}, "temperature=nan"),  # passed `< 0` and returned token 0 every step
    ({"temperature": math.inf}, "temperature=inf"),  # sampled uniformly
    ({"temperature": "0.7"}, "temperature='0.7'"),
    ({"top_p": math.nan}, "top_p=nan"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),  # yielded 3 tokens
    ({"max_new_tokens": 3.0}, "max_new_tokens=3.0"),
    ({"max_new_tokens": True}, "max_new_tokens=True"),
    ({"top_k": 1.5}, "top_k=1.5"),
    ({"seed": 0.5}, "seed=0.5"),
    ({"ignore_eos": 1}, "ignore_eos=1"),
    ({"stop_token_ids": (2, 3.0)}, r"stop_token_ids=\(2, 3.0\)"),
    ({"stop_token_ids": (-1,)}, r"stop_token_ids=\(-1,\)"),
])
def test_invalid_values_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_numpy_and_plain_numbers_are_accepted() -> None:
    p = SamplingParams(max_new_tokens=np.int64(4), temperature=np.float32(0.5), top_k=np.int32(3), seed=7, top_p=1)
    assert p.max_new_tokens == 4 and not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
