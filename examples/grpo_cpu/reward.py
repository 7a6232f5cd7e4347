"""Rule-based reward of the CPU example (verl's `reward.custom_reward_function`): 1.0 when the last integer in
the response is the answer, else a small format term (0.1 per digit character, at most 0.5), so that the
advantages of a random policy's group are not all zero and GRPO's update is exercised."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs) -> float:
    numbers = _INT.findall(solution_str or "")
    if numbers and numbers[-1] == str(ground_truth).strip():
        return 1.0
    return min(0.5, 0.1 * sum(c.isdigit() for c in solution_str or ""))
