"""The target's KV blocks: who holds which, and which full blocks can be shared (automatic prefix caching).

A request holds a block table: its positions' blocks in order. A block whose 16 positions all hold the K/V
of committed tokens (never of drafts still being verified) is registered under the digest of every token
from the sequence's start to the block's end, so another request with the same prefix reuses it instead
of computing it again (vLLM's automatic prefix caching, SGLang's radix cache, TensorRT-LLM's KV block
reuse). The digest covers the whole prefix, not the block's own tokens: K/V at a position depend on
everything before it. It is a 128-bit BLAKE2b chain, so two prefixes sharing a digest is never a concern
in practice; the reused entries are bit-for-bit what recomputing them would give (the engine's kernels
compute each row on its own), so a hit changes no output.

Blocks are reference-counted. A block no request holds stays cached until it is needed for new tokens:
never-registered blocks are reused first, then cached ones, least recently released first (LRU).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from pipeline.engine.kv_cache import blocks_for


@dataclass
class BlockTable:
    """One request's blocks."""

    blocks: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # of its full, committed blocks, in order
    cached_tokens: int = 0  # positions reused from the prefix cache at admission


def chain_digest(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little", signed=True) for t in tokens),
                           digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.digest_of: list[bytes | None] = [None] * num_blocks
        self.by_digest: dict[bytes, int] = {}
        self.empty: list[int] = list(range(num_blocks - 1, -1, -1))  # unregistered, unheld: popped from the end
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld: least recently released first
        # Counters for metrics: prompt positions looked up at admission, and those found cached.
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.empty) + len(self.evictable)

    @property
    def num_held(self) -> int:
        return self.num_blocks - self.num_free

    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks that hold tokens' longest prefix of whole blocks, leaving at least the last token to
        compute (its logits give the next token)."""
        if not self.prefix_caching:
            return []
        hits, parent = [], b""
        for i in range((len(tokens) - 1) // self.block_size):
            parent = chain_digest(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block = self.by_digest.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def admit(self, table: BlockTable, tokens: list[int], lookup: bool = True) -> bool:
        """Give a request the blocks for all of tokens (cached ones where the prefix is cached, unless `lookup` is
        off); False, changing nothing, when the pool can't hold them now."""
        hits = self.match(tokens) if lookup else []
        new = blocks_for(len(tokens), self.block_size) - len(hits)
        if new > self.num_free - sum(1 for b in hits if b in self.evictable):
            return False
        for b in hits:
            self._hold(b)
        table.blocks = hits + [self._take() for _ in range(new)]
        table.digests = [self.digest_of[b] for b in hits]
        table.cached_tokens = len(hits) * self.block_size
        self.queried_tokens += len(tokens)
        self.hit_tokens += table.cached_tokens
        return True

    def grow(self, table: BlockTable, length: int) -> bool:
        """Blocks for positions < length; False (changing nothing) when the pool has too few free."""
        need = blocks_for(length, self.block_size) - len(table.blocks)
        if need > self.num_free:
            return False
        table.blocks += [self._take() for _ in range(max(0, need))]
        return True

    def trim(self, table: BlockTable, length: int) -> None:
        """Release the blocks past positions < length: those only rejected drafts wrote."""
        keep = max(blocks_for(length, self.block_size), len(table.digests))
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())

    def commit(self, table: BlockTable, tokens: list[int], length: int) -> None:
        """Positions < length hold committed tokens' K/V: register every block they fill."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(table.digests), length // bs):
            parent = table.digests[-1] if table.digests else b""
            digest = chain_digest(parent, tokens[i * bs:(i + 1) * bs])
            table.digests.append(digest)
            block = table.blocks[i]
            if digest not in self.by_digest:  # else another request computed the same block first: ours stays private
                self.by_digest[digest] = block
                self.digest_of[block] = digest

    def free(self, table: BlockTable) -> None:
        for b in reversed(table.blocks):  # the prefix's first blocks are released last: evicted last
            self._release(b)
        table.blocks, table.digests = [], []

    def _hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _take(self) -> int:
        if self.empty:
            block = self.empty.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.by_digest[self.digest_of[block]]
            self.digest_of[block] = None
        self.refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.digest_of[block] is None:
                self.empty.append(block)
            else:
                self.evictable[block] = None
