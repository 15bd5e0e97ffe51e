"""Preallocated per-slot KV cache, and the per-forward batch layout that indexes it.

Each running request owns one slot. A slot's length is not stored here: the engine keeps it per
request, so rolling back rejected draft tokens is just moving that length back. Entries past the
length are stale and are never attended to (a query at position p only sees keys at <= p), so
they are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        # [layers, slots, kv_heads, max_seq_len + 1, head_dim]. The last position is a trash row:
        # padding tokens write their K/V there, so a padded batch never clobbers real entries.
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    @property
    def trash_pos(self) -> int:
        return self.max_seq_len

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class ForwardBatch:
    """Where each token of a padded [B, T] forward sits in the cache."""

    slots: torch.Tensor  # [B] long: cache slot of each row
    positions: torch.Tensor  # [B, T] long: rope position of each token (pads clamped into range)
    write_pos: torch.Tensor  # [B, T] long: cache position to write K/V (pads -> trash row)
    attn_mask: torch.Tensor | None  # [B, 1, T, L] bool, True = attend; None = plain causal over L
    kv_len: int  # L: keys 0..L-1 are read from the cache
    slot_range: tuple[int, int] | None  # set when slots are contiguous: read the cache as a view

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int], cache: KVCache,
              device: torch.device | str = "cpu") -> "ForwardBatch":
        """Row i feeds lengths[i] tokens at positions starts[i] .. starts[i] + lengths[i] - 1."""
        B, T = len(slots), max(lengths)
        offs = torch.arange(T)
        start_t = torch.tensor(starts)
        len_t = torch.tensor(lengths)
        pos = start_t[:, None] + offs[None, :]  # [B, T]
        valid = offs[None, :] < len_t[:, None]  # [B, T]
        write_pos = torch.where(valid, pos, torch.full_like(pos, cache.trash_pos))
        positions = pos.clamp(max=cache.max_seq_len - 1)
        kv_len = max(s + n for s, n in zip(starts, lengths))
        same_shape = all(s == starts[0] for s in starts) and all(n == T for n in lengths)
        if same_shape and T == 1:
            mask = None  # one token per row at the same position: every key 0..L-1 is visible
        else:
            # Query at position p sees keys at <= p. Pad queries see key 0 only (their output is dropped),
            # which keeps softmax well defined.
            key_pos = torch.arange(kv_len)
            q_pos = torch.where(valid, pos, torch.zeros_like(pos))
            mask = (key_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, T, L]
        sorted_slots = sorted(slots)
        contiguous = slots == sorted_slots and sorted_slots == list(range(slots[0], slots[0] + B))
        return cls(
            slots=torch.tensor(slots, device=device),
            positions=positions.to(device),
            write_pos=write_pos.to(device),
            attn_mask=None if mask is None else mask.to(device),
            kv_len=kv_len,
            slot_range=(slots[0], slots[0] + B) if contiguous else None,
        )
