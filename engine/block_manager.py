"""The paged KV block pool: block tables, reference counts, prefix caching, LRU eviction.

NOTE (invariants, checked by `check_invariants`):
- a block is in the free queue exactly when its ref_count is 0;
- a block is in the hash map only once its KV is complete (registered by `commit` after
  the step that computed it), and the map entry's token ids equal the block's;
- a freed block keeps its hash and stays reusable by later prompts until the pool hands
  it out for new content, or `flush_prefix_cache` (a fault for the demo) forgets every
  hash at once (both counted as evictions; only the first records an eviction age);
- a hit is never taken on the hash alone: the block's own tokens must equal the prompt's,
  and its recorded parent must be the block just matched, holding the same content as
  when the child was computed (`generation`). A prefix match is thus exact whatever the
  hash does; sha256 only keeps collisions from costing hits (CVE-2025-25183 in vLLM);
- every looked-up block that misses gets one reason (`attribute_misses`): evicted if this
  exact prefix was cached before (its hash is in the evicted-hash memory, or still cached
  behind an evicted ancestor), else diverged if an earlier block of the prompt hit, else
  cold. Blocks a batch-mate is still computing are not cached yet: they count as never seen.
"""
from __future__ import annotations

import hashlib
import random
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from ac_observe.engine.evicted_hashes import DEFAULT_CAPACITY, EvictedHashes
from ac_observe.engine.sequence import Sequence
from ac_observe.metrics import MISS_REASONS


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "parent", "generation",
                 "released_ns")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.parent: tuple[int, int] | None = None  # (block id, its generation) before it
        self.generation = 0                         # bumped whenever it takes new content
        self.released_ns = 0                        # when its last holder let it go


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted at admission. Re-admission after preemption is recompute, never a hit."""
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    recompute_tokens: int = 0
    recompute_reused_tokens: int = 0
    evictions: int = 0
    miss_blocks: list[int] = field(default_factory=lambda: [0] * len(MISS_REASONS))

    def record(self, num_tokens: int, num_query_blocks: int, num_hit_blocks: int,
               block_size: int, preempted: bool, misses: tuple[int, ...] = ()) -> None:
        if preempted:
            self.recompute_tokens += num_tokens
            self.recompute_reused_tokens += num_hit_blocks * block_size
            return
        self.query_blocks += num_query_blocks
        self.hit_blocks += num_hit_blocks
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_blocks * block_size
        for i, count in enumerate(misses):
            self.miss_blocks[i] += count


def chain_hash(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """sha256 over the parent's hash and the block's token ids."""
    return hashlib.sha256((parent_hash or b"\0" * 32)
                          + array("q", token_ids).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 evicted_memory: int = DEFAULT_CAPACITY, clock=time.monotonic_ns):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()
        self.evicted = EvictedHashes(evicted_memory)
        self.clock = clock
        # Seconds each evicted block had been unused; the stats drain it after every step
        # (an engine without instrumentation turns it off: nobody would drain it).
        self.eviction_ages: list[float] = []
        self.track_eviction_ages = True
        # Fault injection (EngineConfig.fault_injection): this share of prompt lookups is
        # refused the cache, as if nothing were cached (drift demos and tests).
        self.forced_miss_ratio = 0.0
        self._fault_rng = random.Random(0)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def fits_ever(self, num_tokens: int) -> bool:
        return (num_tokens + self.block_size - 1) // self.block_size <= self.num_blocks

    def _cached_prefix(self, seq: Sequence, attribute: bool
                       ) -> tuple[list[Block], int, tuple[int, ...]]:
        """Leading full blocks already in the cache, how many blocks were looked up, and
        the misses by reason (MISS_REASONS order; only when `attribute`).

        The last token is never looked up: its logits are needed, so it is always computed.
        The prompt blocks' chain hashes are kept on the sequence for `commit`.
        """
        bs = self.block_size
        num_query = (len(seq.token_ids) - 1) // bs
        hits: list[Block] = []
        # A sequence that waits for room keeps its hashes from the last try (its tokens
        # only change while it holds blocks, and `free` drops them).
        known = seq.block_hashes if len(seq.block_hashes) == num_query else None
        hashes: list[bytes] = []
        misses = [0] * len(MISS_REASONS)
        parent_hash, parent = None, None
        matching = not (self.forced_miss_ratio and
                        self._fault_rng.random() < self.forced_miss_ratio)
        for i in range(num_query):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block_hash = known[i] if known else chain_hash(parent_hash, tokens)
            hashes.append(block_hash)
            parent_hash = block_hash
            if matching:
                block_id = self.hash_to_block.get(block_hash)
                block = self.blocks[block_id] if block_id is not None else None
                # A collision, or a child of content that is gone, is never shared.
                if block is not None and block.token_ids == tokens and block.parent == parent:
                    hits.append(block)
                    parent = (block.block_id, block.generation)
                    continue
                matching = False
                if not attribute:
                    break
            misses[self._miss_reason(block_hash, bool(hits))] += 1
        seq.block_hashes = hashes
        return hits, num_query, tuple(misses)

    def _miss_reason(self, block_hash: bytes, earlier_hit: bool) -> int:
        if block_hash in self.hash_to_block or block_hash in self.evicted:
            return 0  # evicted: this exact prefix was cached; (part of) it was reclaimed
        return 2 if earlier_hit else 1  # diverged | cold

    def try_allocate(self, seq: Sequence, use_cache: bool = True) -> bool:
        """Give a waiting sequence its block table, reusing cached prefix blocks."""
        assert not seq.block_table, "sequence already holds blocks"
        preempted = seq.num_preemptions > 0
        if use_cache:
            hits, num_query, misses = self._cached_prefix(seq, attribute=not preempted)
        else:
            hits, num_query, misses = [], 0, ()
            seq.block_hashes = []
        num_new = seq.num_blocks_needed(self.block_size) - len(hits)
        num_revived = sum(1 for block in hits if block.ref_count == 0)
        if num_new + num_revived > self.num_free_blocks:
            return False
        for block in hits:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
        seq.block_table = [block.block_id for block in hits]
        seq.block_table += [self._take_free_block() for _ in range(num_new)]
        num_hit_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = num_hit_tokens
        seq.num_hashed_blocks = len(hits)
        if use_cache:
            self.stats.record(len(seq.token_ids), num_query, len(hits), self.block_size,
                              preempted, misses)
        if use_cache and not preempted:
            seq.num_cached_tokens = num_hit_tokens
            seq.kv_hit_blocks, seq.kv_query_blocks = len(hits), num_query
            seq.kv_miss_blocks = misses
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                self.stats.evictions += 1
                self.evicted.add(block.block_hash)
                if self.track_eviction_ages:
                    self.eviction_ages.append((self.clock() - block.released_ns) * 1e-9)
            block.block_hash = None
            block.token_ids = ()
            block.parent = None
        block.generation += 1  # children recorded against its old content no longer match
        block.ref_count = 1
        return block_id

    def flush_prefix_cache(self) -> int:
        """Fault injection: forget every cached prefix block, as a reset of the prefix cache
        would; returns how many. Each is counted as an eviction and remembered as evicted,
        so a later lookup of that prefix misses as `evicted`; a block that a running
        sequence holds stays its holder's, private (handed out first once freed)."""
        now = self.clock()
        flushed = list(self.hash_to_block.items())
        for block_hash, block_id in flushed:
            block = self.blocks[block_id]
            del self.hash_to_block[block_hash]
            self.evicted.add(block_hash)
            self.stats.evictions += 1
            if block.ref_count == 0:
                self.free_queue.move_to_end(block_id, last=False)
                if self.track_eviction_ages:
                    self.eviction_ages.append((now - block.released_ns) * 1e-9)
        return len(flushed)

    def can_append(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the KV of the sequence's last token (the next step's input)."""
        if len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self._take_free_block())

    def commit(self, seq: Sequence) -> None:
        """After a step: register every block whose KV is now complete in the prefix cache."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            parent = self.blocks[seq.block_table[i - 1]] if i else None
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block.block_hash = (seq.block_hashes[i] if i < len(seq.block_hashes) else
                                chain_hash(parent.block_hash if parent else None, tokens))
            block.token_ids = tokens
            block.parent = (parent.block_id, parent.generation) if parent else None
            # A twin computed in the same step keeps the entry; this copy stays private.
            self.hash_to_block.setdefault(block.block_hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence; cached blocks stay reusable until evicted."""
        now = self.clock()
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                block.released_ns = now
                self.free_queue[block_id] = None
                if self.hash_to_block.get(block.block_hash) != block_id:
                    # Holds nothing a later prompt can reuse: hand it out first.
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def check_invariants(self, live: list[Sequence]) -> None:
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} "
                                     f"but {refs[block.block_id]} holders")
            if (block.ref_count == 0) != (block.block_id in self.free_queue):
                raise AssertionError(f"block {block.block_id}: free queue disagrees with ref_count")
        for block_hash, block_id in self.hash_to_block.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise AssertionError(f"hash map points at block {block_id} with another hash")
