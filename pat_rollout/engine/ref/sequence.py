"""Sequence: one request's mutable decoding state inside the reference engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from pat_rollout.types import RequestOutput, RequestState, SamplingParams


@dataclass(eq=False, slots=True)
class Sequence:
    """Tokens [0, num_cached) have K/V in the blocks of `block_table`; each step feeds the
    tokens [num_cached, num_tokens) and samples one new token."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    token_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)

    @classmethod
    def from_state(cls, state: RequestState) -> Sequence:
        return cls(request_id=state.request_id, prompt_token_ids=tuple(state.prompt_token_ids),
                   sampling=state.sampling, token_ids=[*state.prompt_token_ids, *state.output_token_ids],
                   output_log_probs=list(state.output_log_probs))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self.token_ids[len(self.prompt_token_ids):])

    def to_state(self) -> RequestState:
        return RequestState(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                            output_token_ids=self.output_token_ids, output_log_probs=tuple(self.output_log_probs),
                            sampling=self.sampling, num_cached_tokens=self.num_cached)

    def to_output(self, finish_reason: str) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                             token_ids=self.output_token_ids, log_probs=tuple(self.output_log_probs),
                             finish_reason=finish_reason)

    def finish_reason(self, eos_token_ids: tuple[int, ...]) -> str | None:
        """Why decoding stops after the last sampled token, or None to continue."""
        last, sp = self.token_ids[-1], self.sampling
        if (not sp.ignore_eos and last in eos_token_ids) or last in sp.stop_token_ids:
            return "stop"
        return "length" if self.num_output_tokens >= sp.max_new_tokens else None


def max_cached_tokens(num_prompt_tokens: int, max_new_tokens: int) -> int:
    """Most tokens a request ever holds in the cache: the last sampled token is never fed back."""
    return num_prompt_tokens + max_new_tokens - 1
