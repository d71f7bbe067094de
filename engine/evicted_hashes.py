"""A bounded memory of evicted prefix-block hashes: was this block ever cached and reclaimed?

Each hash is kept as a 64-bit fingerprint (its first 8 bytes, lowest bit forced to 1 so
that 0 marks an empty slot) in one of two fixed-size open-addressing tables. Insertions go
to the current table; when it holds `capacity // 2` fingerprints, the other table is
emptied and becomes current. So:

- memory is fixed at construction: two `array('Q')` of a power of two >= capacity slots
  each (load factor <= 1/2), 8 bytes a slot: 16-32 bytes per remembered hash;
- the last `capacity // 2` evictions are always remembered, and at most `capacity` are;
  older ones are forgotten, and a miss on a forgotten block is told as never seen;
- a hash never evicted is answered "evicted" only when its fingerprint equals a stored
  one: at most n / 2^63 per lookup with n <= capacity fingerprints stored (about 1e-13 at
  a million), since sha256 spreads hashes uniformly.

NOTE: torch-free and single-threaded (the engine's lock guards the block manager).
"""
from __future__ import annotations

from array import array

DEFAULT_CAPACITY = 1 << 18
MIN_CAPACITY = 16


def _fingerprint(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little") | 1


class EvictedHashes:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < MIN_CAPACITY:
            raise ValueError(f"the evicted-hash memory holds at least {MIN_CAPACITY} hashes")
        self.capacity = capacity
        self._half = capacity // 2
        self._slots = 1 << max(capacity - 1, 1).bit_length()  # a power of two >= capacity
        self._mask = self._slots - 1
        self._tables = [self._empty(), self._empty()]
        self._current = 0
        self._fill = 0  # fingerprints in the current table

    def _empty(self) -> array:
        return array("Q", bytes(8 * self._slots))

    @property
    def nbytes(self) -> int:
        return sum(table.itemsize * len(table) for table in self._tables)

    def __len__(self) -> int:
        """Fingerprints held (one hash in both tables counts twice)."""
        return sum(1 for table in self._tables for slot in table if slot)

    def _probe(self, table: array, fp: int) -> tuple[bool, int]:
        """(found, slot): the fingerprint's slot, or the empty slot where it would go."""
        mask = self._mask
        i = (fp >> 1) & mask
        while True:
            slot = table[i]
            if slot == fp:
                return True, i
            if slot == 0:
                return False, i
            i = (i + 1) & mask

    def add(self, block_hash: bytes) -> None:
        fp = _fingerprint(block_hash)
        table = self._tables[self._current]
        found, i = self._probe(table, fp)
        if found:
            return
        if self._fill >= self._half:
            self._current ^= 1
            self._tables[self._current] = table = self._empty()
            self._fill = 0
            _, i = self._probe(table, fp)
        table[i] = fp
        self._fill += 1

    def __contains__(self, block_hash: bytes) -> bool:
        fp = _fingerprint(block_hash)
        return any(self._probe(table, fp)[0] for table in self._tables)
