"""vLLM v1's KV block pool with automatic prefix caching, as a pure model.

Follows ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py``:

* Usable blocks are numbered ``1..num_usable`` (block 0 is vLLM's null block and never handed
  out). Every block has a reference count; a block with count 0 is *free* and sits in the free
  queue, whether or not it still holds cached content.
* A *full* block can be cached under a hash that chains its parent's hash with its token ids
  (and extra keys such as the cache salt), so equal hashes mean equal prefixes from the start of
  the sequence. The cache maps a hash to the blocks holding it (vLLM does not de-duplicate: a
  block filled by one request while another holds the same content keeps its own id).
* Freeing decrements counts; a block reaching 0 keeps its hash and goes to the **tail** of the
  free queue. Allocation takes from the **head** and drops the hash of a cached block it takes
  (eviction), so cached-but-unreferenced blocks are evicted least recently freed first and only
  when a new block is needed.
* ``touch`` takes a cached block for a request that hit it: count + 1, and out of the free queue
  if it was there.

With caching disabled nothing is ever hashed or looked up and the pool is a plain counter of
free blocks (the free queue order is then irrelevant).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = bytes
"""A sha256 digest chaining a block's parent hash, token ids and extra keys."""

_ROOT = b"kv-gateway.sim/root"


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """The hash of one full block; ``parent`` is None for the first block of a sequence.

    Deterministic across processes (sha256 over a fixed encoding), like vLLM's default
    ``prefix_caching_hash_algo="sha256"``; the bytes are this simulator's, not vLLM's.
    """
    digest = hashlib.sha256(parent if parent is not None else _ROOT)
    digest.update(struct.pack(f">I{len(token_ids)}I", len(token_ids), *token_ids))
    for key in extra_keys:
        data = key.encode()
        digest.update(struct.pack(">I", len(data)) + data)
    return digest.digest()


class BlockPool:
    """Reference-counted blocks, a free queue in eviction order and the prefix cache.

    Contract (checked by ``audit``): every count is >= 0; a block is in the free queue exactly
    when its count is 0; every hash in the cache map belongs to a block holding that hash;
    ``num_free + num_used == num_usable``. Callers never allocate more than ``num_free``.
    """

    def __init__(self, num_usable: int, *, enable_caching: bool) -> None:
        if num_usable < 0:
            raise ValueError("num_usable must be >= 0")
        self.num_usable = num_usable
        self.enable_caching = enable_caching
        self._ref = [0] * (num_usable + 1)  # index 0: the null block, never used
        self._hash: list[BlockHash | None] = [None] * (num_usable + 1)
        # Free blocks, head = next to allocate. Initially in id order, as in vLLM.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_usable + 1))
        self._cached: dict[BlockHash, dict[int, None]] = {}

    # -- reading --------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with no reference: never used, or cached and evictable."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_usable - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a hash (referenced or not)."""
        return sum(len(ids) for ids in self._cached.values())

    @property
    def num_evictable(self) -> int:
        """Free blocks that still hold cached content."""
        return sum(1 for block_id in self._free if self._hash[block_id] is not None)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def free_queue(self) -> tuple[int, ...]:
        """Free block ids, head (allocated next) first."""
        return tuple(self._free)

    def longest_hit(self, hashes: Iterable[BlockHash]) -> list[int]:
        """Cached blocks for the longest prefix of ``hashes``; stops at the first miss.

        For a hash held by several blocks the first cached one is used, as vLLM does.
        """
        if not self.enable_caching:
            return []
        hit: list[int] = []
        for block_hash in hashes:
            holders = self._cached.get(block_hash)
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    # -- changing -------------------------------------------------------------------------

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks a request hit (out of the free queue if free)."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` new blocks from the head of the free queue, each with one reference.

        A cached block taken this way is evicted (its hash dropped). Raises ``ValueError`` when
        fewer than ``count`` blocks are free; callers check ``num_free`` first.
        """
        if count > len(self._free):
            raise ValueError(f"cannot allocate {count} blocks, {len(self._free)} free")
        taken: list[int] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref[block_id] = 1
            taken.append(block_id)
        return taken

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that the (referenced, full) block ``block_id`` holds ``block_hash``."""
        if not self.enable_caching:
            return
        if self._hash[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached")
        self._hash[block_id] = block_hash
        self._cached.setdefault(block_hash, {})[block_id] = None

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block, in eviction order (first evicted first).

        A block left without reference goes to the tail of the free queue, keeping its hash.
        """
        for block_id in block_ids:
            if self._ref[block_id] <= 0:
                raise ValueError(f"block {block_id} is not referenced")
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def audit(self) -> None:
        """Raise ``AssertionError`` if the contract in the class docstring does not hold."""
        for block_id in range(1, self.num_usable + 1):
            ref = self._ref[block_id]
            assert ref >= 0, f"block {block_id}: count {ref}"
            assert (ref == 0) == (block_id in self._free), f"block {block_id}: free and used"
        for block_hash, holders in self._cached.items():
            for block_id in holders:
                assert self._hash[block_id] == block_hash, f"block {block_id}: stale cache entry"
        held = sum(1 for h in self._hash if h is not None)
        assert held == self.num_cached, "a hashed block is missing from the cache map"
        assert self.num_free + self.num_used == self.num_usable

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        if block_hash is None:
            return
        self._hash[block_id] = None
        holders = self._cached[block_hash]
        del holders[block_id]
        if not holders:
            del self._cached[block_hash]
