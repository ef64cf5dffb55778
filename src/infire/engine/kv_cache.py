"""The KV block pools' bookkeeping: free blocks, reference counts and the prefix cache.

The pools themselves are tensors owned by the model runner; this module only decides
which block ids a sequence uses. A full block whose KV has been computed is keyed by a
chained content hash, SHA-256(parent key + its token ids as little-endian uint32), so any
request whose prompt starts with the same tokens reuses it, and every process (engine
cores, the disaggregation balancer) computes the same key. SHA-256 makes a collision,
which would silently serve another prompt's KV, out of reach, so keys are trusted without
comparing tokens. Blocks nobody references stay cached until evicted, least recently
freed first.

A model with windowed attention layers (layers/kv_spec.py) has one more pool per window:
a sequence holds a block table in each, growing with the main one, and the blocks that
fall out of the window are released as it grows (their entries read -1), so those pools
are bounded by the window. They cache blocks under the same keys: a prompt reuses a
cached prefix when the main pool has all of its blocks and every windowed pool has the
blocks that the prefix's last window spans.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from infire.engine.request import Sequence
from infire.layers.kv_spec import AttentionWindow


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Key of a full block: depends on every token of the prefix, not just this block's."""
    digest = hashlib.sha256(parent or b"")
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return digest.digest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Keys of every full block of a token sequence, in order."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys.append(block_hash(keys[-1] if keys else None, token_ids[start : start + block_size]))
    return keys


class BlockPool:
    """One pool's blocks: reference counts, the free (evictable) list and the cached keys."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: dict[int, bytes] = {}
        self.block_of_hash: dict[bytes, int] = {}
        # Unreferenced blocks in eviction order; cached ones keep their hash until reused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (free or evictable)."""
        return len(self.free_blocks)

    def take(self) -> int:
        """A free block (evicting its cached key, if any), referenced once."""
        block, _ = self.free_blocks.popitem(last=False)
        key = self.hash_of_block.pop(block, None)
        if key is not None:
            del self.block_of_hash[key]
        self.ref_counts[block] = 1
        return block

    def reference(self, block: int) -> None:
        """One more holder of `block` (taken off the free list if it was there)."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; an unheld block goes back: cached ones to be evicted last,
        uncached ones to be reused first."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None
            if block not in self.hash_of_block:
                self.free_blocks.move_to_end(block, last=False)

    def cache(self, block: int, key: bytes) -> None:
        """Register a full, computed block under its key (the first block with a key wins)."""
        if key not in self.block_of_hash:
            self.block_of_hash[key] = block
            self.hash_of_block[block] = key

    def reset(self) -> None:
        """Forget every cached key."""
        self.block_of_hash.clear()
        self.hash_of_block.clear()


class WindowPool(BlockPool):
    """The pool of one windowed KV group."""

    def __init__(self, window: AttentionWindow, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.window = window

    def first_block(self, position: int, block_size: int) -> int:
        """The first block a query at `position` reads."""
        return self.window.first_visible(position) // block_size

    def release_out_of_window(self, table: list[int], first_token: int, block_size: int) -> None:
        """Release the table's blocks wholly before the window of token `first_token` (-1
        marks a released entry; they form a prefix, so the scan stops at the first one)."""
        end = self.first_block(first_token, block_size)
        for i in range(min(end, len(table)) - 1, -1, -1):
            if table[i] < 0:
                break
            self.release(table[i])
            table[i] = -1

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences."""
        return self.num_blocks - self.num_free_blocks


class BlockManager:
    """Allocates fixed-size KV blocks to sequences, with prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        windows: list[tuple[AttentionWindow, int]] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.windows = [WindowPool(window, blocks) for window, blocks in windows or []]

    @property
    def num_free_blocks(self) -> int:
        """Blocks of the main pool that an allocation may take (free or evictable)."""
        return self.pool.num_free_blocks

    @property
    def block_of_hash(self) -> dict[bytes, int]:
        """The main pool's cached blocks by key."""
        return self.pool.block_of_hash

    @property
    def usage(self) -> float:
        """Fraction of the main pool referenced by live sequences (vLLM's kv_cache_usage)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def acquire_cached_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its prompt's longest cached prefix.

        Returns the number of tokens covered. At least one prompt token is always left
        to compute, since its logits are needed to sample.
        """
        if not self.enable_prefix_caching:
            return 0
        keys: list[bytes] = []
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            key = block_hash(keys[-1] if keys else None, tokens)
            if key not in self.pool.block_of_hash:
                break
            keys.append(key)
        count = len(keys)
        while count and not self._windows_hold(keys, count):
            count -= 1
        for key in keys[:count]:
            block = self.pool.block_of_hash[key]
            self.pool.reference(block)
            seq.block_table.append(block)
            seq.block_hashes.append(key)
        if self.windows:
            seq.window_block_tables = [self._window_prefix(p, keys, count) for p in self.windows]
        return count * self.block_size

    def _windows_hold(self, keys: list[bytes], count: int) -> bool:
        """Whether every windowed pool caches the blocks the first token after `count`
        blocks sees."""
        for pool in self.windows:
            first = pool.first_block(count * self.block_size, self.block_size)
            if any(key not in pool.block_of_hash for key in keys[first:count]):
                return False
        return True

    def _window_prefix(self, pool: WindowPool, keys: list[bytes], count: int) -> list[int]:
        first = pool.first_block(count * self.block_size, self.block_size)
        table = [-1] * first
        for key in keys[first:count]:
            block = pool.block_of_hash[key]
            pool.reference(block)
            table.append(block)
        return table

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block tables to hold `num_tokens`; False (and no change but released
        out-of-window blocks) if a pool is short."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if self.windows:
            if not seq.window_block_tables:
                seq.window_block_tables = [[] for _ in self.windows]
            first = seq.num_computed_tokens  # the first token this step computes
            for pool, table in zip(self.windows, seq.window_block_tables, strict=True):
                pool.release_out_of_window(table, first, self.block_size)
                if needed > pool.num_free_blocks:
                    return False
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self.pool.take())
        for pool, table in zip(self.windows, seq.window_block_tables, strict=True):
            table += [pool.take() for _ in range(needed)]
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of seq; cached blocks stay reusable until evicted."""
        # a waiting or preempted sequence holds no window tables
        for pool, table in zip(self.windows, seq.window_block_tables, strict=False):
            for block in reversed(table):
                if block >= 0:
                    pool.release(block)
        seq.window_block_tables = []
        # Tail blocks first, so that they are evicted before the shared prefix.
        for block in reversed(seq.block_table):
            self.pool.release(block)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that became full and computed this step."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            key = block_hash(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(key)
            self.pool.cache(seq.block_table[i], key)
            for pool, table in zip(self.windows, seq.window_block_tables, strict=True):
                if table[i] >= 0:
                    pool.cache(table[i], key)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after weights change)."""
        for pool in (self.pool, *self.windows):
            pool.reset()
