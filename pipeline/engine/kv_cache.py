"""The KV cache as a pool of fixed-size blocks, and the per-forward batch layout that indexes it.

Position p of a sequence lives at offset p % block_size of block table[p // block_size], its row of the
block table. The target's blocks are handed out by the BlockManager (block_manager.py): a request holds
only the blocks its tokens fill, and full blocks are shared between requests with the same prefix. A
draft model's or an EAGLE-3 head's small cache keeps a fixed run of blocks per batch slot (slot_blocks).

A sequence's length is not stored here: the engine keeps it per request, so rolling back rejected draft
tokens is just moving that length back. Entries past the length are stale and are never attended to (a
query at position p only sees keys at <= p), so they are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BLOCK_SIZE = 16  # tokens per block: vLLM's default; a whole number of the attention kernel's 16-key lanes


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 num_blocks: int | None = None, block_size: int = BLOCK_SIZE):
        """num_blocks: the pool's size; default one max_seq_len run per slot (num_slots x max_seq_len tokens)."""
        self.block_size = block_size
        self.blocks_per_slot = blocks_for(max_seq_len, block_size)
        self.num_blocks = num_slots * self.blocks_per_slot if num_blocks is None else num_blocks
        # [layers, blocks + 1, kv_heads, block_size, head_dim]. The last block is trash: the torch ops write a
        # padding token's K/V there, so a padded batch never clobbers real entries (the C kernels skip pads).
        shape = (num_layers, self.num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len

    @property
    def trash_block(self) -> int:
        return self.num_blocks

    def slot_blocks(self, slot: int) -> list[int]:
        """The fixed blocks of a slot, for the caches that keep one max_seq_len run per slot."""
        if not 0 <= slot < self.num_slots:
            return [self.num_blocks + 1]  # past the pool: refused by the kernels and by torch's indexing alike
        return list(range(slot * self.blocks_per_slot, (slot + 1) * self.blocks_per_slot))

    def bytes_per_block(self) -> int:
        return self.k[:, 0].numel() * self.k.element_size() * 2

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class ForwardBatch:
    """Where each token of a padded [B, T] forward sits in the cache."""

    block_table: torch.Tensor  # [B, MB] long: each row's blocks, trash-padded to the longest row's
    positions: torch.Tensor  # [B, T] long: rope position of each token (pads clamped into range)
    write_pos: torch.Tensor  # [B, T] long: position to write K/V, -1 for pads
    kv_len: int  # L: keys 0..L-1 are read from the cache
    block_size: int
    trash_block: int
    all_keys: bool = False  # one token per row, all at the same position: every key 0..L-1 is visible (no mask)
    _write_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """[B, 1, T, L] bool, True = attend; None when every key is visible. Only SDPA reads it (the GPU's vendor
        path), so it is made on the device on first use, not sent from the host every step. A query at position
        p sees keys at <= p; a pad sees key 0 only (its output is dropped), which keeps softmax well defined."""
        if self.all_keys:
            return None
        if self._mask is None:
            key_pos = torch.arange(self.kv_len, device=self.write_pos.device)
            self._mask = (key_pos[None, None, :] <= self.write_pos.clamp(min=0)[:, :, None])[:, None]
        return self._mask

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int], cache: KVCache,
              device: torch.device | str = "cpu") -> "ForwardBatch":
        """Row i is slot slots[i] of a per-slot cache, fed lengths[i] tokens from position starts[i]."""
        return cls.paged([cache.slot_blocks(s) for s in slots], starts, lengths, cache, device)

    @classmethod
    def paged(cls, tables: list[list[int]], starts: list[int], lengths: list[int], cache: KVCache,
              device: torch.device | str = "cpu") -> "ForwardBatch":
        """Row i has blocks tables[i] and feeds lengths[i] tokens at positions starts[i] .. + lengths[i] - 1."""
        T = max(lengths)
        kv_len = max(s + n for s, n in zip(starts, lengths))
        width = blocks_for(kv_len, cache.block_size)
        trash = cache.trash_block
        table = torch.tensor([list(t[:width]) + [trash] * (width - len(t[:width])) for t in tables], dtype=torch.long)
        offs = torch.arange(T)
        start_t = torch.tensor(starts)
        len_t = torch.tensor(lengths)
        pos = start_t[:, None] + offs[None, :]  # [B, T]
        valid = offs[None, :] < len_t[:, None]  # [B, T]
        write_pos = torch.where(valid, pos, torch.full_like(pos, -1))
        positions = pos.clamp(max=cache.max_seq_len - 1)
        same_shape = all(s == starts[0] for s in starts) and all(n == T for n in lengths)
        return cls(block_table=table.to(device), positions=positions.to(device), write_pos=write_pos.to(device),
                   kv_len=kv_len, block_size=cache.block_size, trash_block=trash, all_keys=same_shape and T == 1)

    def write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [B, T] where each token's K/V goes; pads go to the trash block. Worked out once a
        forward, not once a layer (on a GPU each op is a kernel launch)."""
        if self._write_index is None:
            pos = self.write_pos.clamp(min=0)
            block = self.block_table.gather(1, pos // self.block_size)
            block = torch.where(self.write_pos < 0, torch.full_like(block, self.trash_block), block)
            self._write_index = (block, pos % self.block_size)
        return self._write_index

    def keys(self, layer_cache: torch.Tensor, row: int | None, width: int) -> torch.Tensor:
        """layer_cache [NB + 1, KV, BS, D] -> positions 0..width-1 of one row ([1, KV, width, D]) or of every row
        ([B, KV, width, D]), gathered from their blocks; blocks past the table read the trash block."""
        n = blocks_for(width, self.block_size)
        table = self.block_table if row is None else self.block_table[row:row + 1]
        if table.shape[1] < n:
            table = torch.nn.functional.pad(table, (0, n - table.shape[1]), value=self.trash_block)
        blocks = layer_cache[table[:, :n]]  # [B, n, KV, BS, D]
        B, _, KV, BS, D = blocks.shape
        return blocks.transpose(1, 2).reshape(B, KV, n * BS, D)[:, :, :width]
