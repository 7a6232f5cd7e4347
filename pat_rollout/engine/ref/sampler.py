"""Greedy and seeded temperature / top-k / top-p sampling, batch- and layout-independent.

The noise of a request's j-th output token is a pure function of (sampling.seed, j): each sampled
row draws Gumbel noise from its own generator seeded by splitmix64(seed, j), and the token is the
argmax of filtered_logits / temperature + noise (Gumbel-max = a draw from the softmax). So which
other requests share the batch, preemption, migration and the TP size never change the draw.

Returned log-probs are log_softmax of the *raw* logits (no temperature, no top-k/top-p) at the
chosen token: the policy's log-probability, which is what RL training consumes.
"""

from __future__ import annotations

import torch

from pat_rollout.types import SamplingParams

_MASK64 = (1 << 64) - 1


def noise_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index), folded to the 63 bits torch.Generator accepts."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def gumbel_noise(seed: int, index: int, vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(noise_seed(seed, index))
    u = torch.rand(vocab_size, generator=g, dtype=torch.float64).clamp_(min=1e-300)
    return -torch.log(-torch.log(u))


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf. top_k <= 0
    or top_p >= 1 disables a filter for that row. The best token always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1]).unsqueeze(0)
    drop = (top_k.unsqueeze(1) > 0) & (rank >= top_k.unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive: a token is kept if the mass above it < top_p
    drop |= mass_before >= top_p.unsqueeze(1)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           output_index: list[int]) -> tuple[list[int], list[float]]:
    """logits [B, vocab] (identical on all TP ranks) -> (token ids, raw log-probs of them).
    `output_index[b]` is how many tokens row b's request has already generated."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_probs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    rows = [b for b, p in enumerate(params) if not p.is_greedy]
    if rows:
        temperature = torch.tensor([params[b].temperature for b in rows], dtype=torch.float64)
        sub = logits[rows].double() / temperature.unsqueeze(1)
        sub = filter_logits(sub, torch.tensor([params[b].top_k for b in rows]),
                            torch.tensor([params[b].top_p for b in rows], dtype=torch.float64))
        noise = torch.stack([gumbel_noise(params[b].seed, output_index[b], logits.shape[-1]) for b in rows])
        tokens[rows] = (sub + noise).argmax(dim=-1)
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()
