"""Paged KV cache bookkeeping: which block of the pool belongs to whom (no tensors here).

`num_blocks` blocks of `block_size` slots. A block is in use (`ref_count > 0`, in one or more block
tables) or free (on the free list); a free block may still hold registered full-block content that a
later request with that prefix revives; allocating takes the least recently freed block and forgets its
hash. `track_events` records every change of the hash map for `take_events` (a router mirrors it). One
manager per KV group (`KVGroupSpec`): a sliding group frees blocks behind the window while their request
runs, `hole` (the scratch block, never handed out) taking their entries, which `acquire`,
`can_allocate` and `free_blocks` skip; `longest_hit` is how far a prefix hit may go in the group.
Contract: check, then act (`can_allocate` before `allocate`); every block from `allocate` or `acquire`
is given back exactly once per reference; with nothing running, `num_free_blocks == num_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.block_keys import BlockHash


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers that attend alike and share a block table: `window` positions (0: the whole context),
    `layers` their indices, `num_blocks` the blocks of their pool (the scratch block not counted)."""

    window: int
    layers: tuple[int, ...]
    num_blocks: int


def first_seen_block(position: int, window: int, block_size: int) -> int:
    """The first block a query at `position` reads with `window` (0: block 0)."""
    return max(0, position - window + 1) // block_size if window else 0


class BlockManager:
    """Reference-counted blocks, an O(1) free list and the prefix cache map."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hole = num_blocks  # a block table's entry for a block freed while its request runs
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Ordered set of free block ids: allocation pops the oldest, revival removes from the middle.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.prefix_hit_blocks = 0
        self.prefix_query_blocks = 0
        self.track_events = False
        self._events: dict[BlockHash, bool] = {}  # hash → reusable now, since the last take_events

    def renewed(self) -> BlockManager:
        """A fresh manager over the same pool (every block free, no hash registered) that keeps this one's
        settings and cumulative prefix-cache figures: the engine's `reset` after a failed loop."""
        bm = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        bm.track_events = self.track_events
        bm.prefix_hit_blocks, bm.prefix_query_blocks = self.prefix_hit_blocks, self.prefix_query_blocks
        return bm

    def take_events(self) -> dict[BlockHash, bool]:
        """The prefix cache's changes since the previous call (hash → True stored, False removed; only
        the latest change of each hash), when `track_events` is on."""
        events, self._events = self._events, {}
        return events

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks holding the longest cached prefix of the chain `hashes` (nothing is acquired)."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def longest_hit(self, hashes: Sequence[BlockHash], window: int, limit: int) -> int:
        """The largest j <= `limit` at which a request may start with the KV of blocks before j found in
        this group: all of them (window 0), or those a query at position j * block_size reads (the
        window's); 0 when prefix caching is off. Nothing is acquired."""
        if not self.enable_prefix_caching:
            return 0
        if not window:
            return min(limit, len(self.match_prefix(hashes[:limit])))
        j = limit
        while j > 0:
            first = first_seen_block(j * self.block_size, window, self.block_size)
            miss = next((i for i in range(j - 1, first - 1, -1) if hashes[i] not in self.cached), None)
            if miss is None:
                return j
            j = miss  # every start past `miss` reads block `miss` too
        return 0

    def hit_table(self, hashes: Sequence[BlockHash], window: int) -> list[int]:
        """This group's table for a hit of len(hashes) blocks (`longest_hit` allowed it): the cached
        blocks, holes before the window of the first query."""
        first = first_seen_block(len(hashes) * self.block_size, window, self.block_size)
        return [self.hole] * first + [self.cached[h] for h in hashes[first:]]

    def can_allocate(self, num_new: int, hit_blocks: Sequence[int] = ()) -> bool:
        """True when `num_new` fresh blocks can be allocated after `hit_blocks` are acquired (those of them
        that are free now leave the free list)."""
        revived = sum(1 for b in hit_blocks if b != self.hole and self.ref_counts[b] == 0)
        return num_new + revived <= len(self.free)

    def acquire(self, blocks: Sequence[int]) -> None:
        """Takes one more reference on each cached block of a prefix hit (holes skipped)."""
        for b in blocks:
            if b == self.hole:
                continue
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def allocate(self, num_new: int) -> list[int]:
        """`num_new` fresh blocks with one reference each; their old cached content is forgotten."""
        assert num_new <= len(self.free), "allocate without can_allocate"
        blocks: list[int] = []
        for _ in range(num_new):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:
                if self.cached.get(old) == b:
                    del self.cached[old]
                    if self.track_events:
                        self._events[old] = False
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Drops one reference on each block; a block reaching zero goes to the free list, keeping its
        cached content. Tail blocks are freed first so that they are reused before shared prefixes."""
        for b in reversed(blocks):
            if b == self.hole:
                continue
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Records that the full `block` holds the prefix chain ending in `block_hash`."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash
            if self.track_events:
                self._events[block_hash] = True

    def record_query(self, queried: int, hit: int) -> None:
        """Counts one admitted request's prefix look-up: `queried` full blocks, `hit` of them cached."""
        self.prefix_query_blocks += queried
        self.prefix_hit_blocks += hit
