"""Batched attention over the paged KV cache, plus the per-step metadata every layer shares.

Tokens of a step are flat ([N, ...], prefill and decode mixed). For attention each sequence's
queries are gathered into a padded [B, Qmax] grid and its keys/values, read from the pool through
the block table, into [B, Tmax]; one scaled_dot_product_attention call with a causal+length mask
serves the whole batch (decode is the Qmax == 1 case, with no query gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    positions: torch.Tensor  # [N] position of each new token in its sequence
    cos: torch.Tensor  # [N, head_dim] RoPE at `positions`
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [N] pool slot each new token's K/V is written to
    kv_slots: torch.Tensor  # [B, Tmax] pool slots of every cached key of each sequence (padded)
    mask: torch.Tensor  # [B, 1, Qmax, Tmax] bool: key visible to query
    q_index: torch.Tensor | None  # [B, Qmax] flat token of each (sequence, query); None when Qmax == 1
    out_index: torch.Tensor | None  # [N] row of the flattened [B * Qmax] grid holding each token
    last_index: torch.Tensor  # [B] flat index of each sequence's last new token (its logits row)


def build_metadata(token_starts: list[int], token_ends: list[int], block_tables: list[list[int]], block_size: int,
                   cos_table: torch.Tensor, sin_table: torch.Tensor) -> AttentionMetadata:
    """Metadata for sequences feeding tokens [start, end) each; all index math is batched."""
    starts = torch.tensor(token_starts)
    ends = torch.tensor(token_ends)
    num_new = ends - starts
    num_seqs, num_tokens = len(token_starts), int(num_new.sum())
    q_max, t_max = int(num_new.max()), int(ends.max())
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables])
    key_pos = torch.arange(t_max)
    kv_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size
    cu_end = num_new.cumsum(0)
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs), num_new)
    offset_in_seq = torch.arange(num_tokens) - (cu_end - num_new)[seq_idx]
    positions = starts[seq_idx] + offset_in_seq
    q_slot = torch.arange(q_max)
    valid_q = q_slot.unsqueeze(0) < num_new.unsqueeze(1)
    # Padding queries sit at position 0 so their mask row keeps key 0 (an all-False row gives NaN).
    q_pos = (starts.unsqueeze(1) + q_slot) * valid_q
    mask = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)
    q_index = out_index = None
    if q_max > 1:
        q_index = ((cu_end - num_new).unsqueeze(1) + q_slot) * valid_q
        out_index = seq_idx * q_max + offset_in_seq
    return AttentionMetadata(positions=positions, cos=cos_table[positions], sin=sin_table[positions],
                             slot_mapping=kv_slots[seq_idx, positions], kv_slots=kv_slots, mask=mask,
                             q_index=q_index, out_index=out_index, last_index=cu_end - 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    md: AttentionMetadata) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D]; kv_layer [2, num_slots, Hkv, D] is this layer's pool.
    Writes the new K/V, attends over the cache, returns [N, Hq * D]."""
    kv_layer[0].index_copy_(0, md.slot_mapping, k)
    kv_layer[1].index_copy_(0, md.slot_mapping, v)
    keys = kv_layer[0][md.kv_slots].transpose(1, 2)  # [B, Hkv, Tmax, D]
    values = kv_layer[1][md.kv_slots].transpose(1, 2)
    num_heads, head_dim = q.shape[1], q.shape[2]
    queries = (q.unsqueeze(1) if md.q_index is None else q[md.q_index]).transpose(1, 2)  # [B, Hq, Qmax, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=md.mask,
                                         enable_gqa=num_heads != keys.shape[1])
    out = out.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [B * Qmax, Hq * D]
    return out if md.out_index is None else out[md.out_index]
