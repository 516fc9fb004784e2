"""Prefix caching as the gateway models it: block hashes of a prompt, and what each engine
is expected to hold in its prefix cache.

vLLM (v1, on by default) caches full KV blocks by a hash chained from the start of the
sequence: block i's hash covers block i−1's hash and block i's token ids (and extra keys: the
LoRA adapter, multimodal hashes, a `cache_salt`). A request whose first full blocks hash
alike takes the cached blocks instead of computing them; at least its last prompt token is
always computed, so a hit covers at most `floor((prompt_tokens − 1) / block_size)` blocks.

The gateway cannot read the engines' caches, so it keeps its own record of what it sent
where (`PrefixIndex`): per engine, the block hashes of the prompts it routed there, in LRU
order, at most as many as the engine has blocks (vLLM cannot cache more), forgotten when
the engine restarts. The hashes are the gateway's own (`block_hashes`: BLAKE2b, stable across
processes and replicas), not vLLM's: equal prefixes hash alike on both sides, which is all
the index needs.

Pure: no I/O, no clock (LRU order is the order of calls).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Container, Sequence

BlockHash = bytes
"""An 8-byte chained hash of one full block (and every block before it)."""

DIGEST_BYTES = 8


def block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none).

    `extra` goes into the first block's hash: whatever makes equal token ids not share
    (the served model or adapter, a request's `cache_salt`), as vLLM's extra keys do."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[BlockHash] = []
    parent = extra
    full = len(token_ids) // block_size
    for i in range(full):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=DIGEST_BYTES).digest()
        hashes.append(parent)
    return hashes


def extra_for(model: str, salt: bytes = b"") -> bytes:
    """The `extra` of a prompt for `model` with `cache_salt` `salt` (empty: none): the model
    (a LoRA adapter is its own model id) and the salt, as vLLM's extra keys separate them."""
    return model.encode() + b"\0" + salt


def hit_cap(prompt_tokens: int, block_size: int) -> int:
    """The most blocks of a prompt a cache hit can cover: vLLM computes the last prompt
    token in any case."""
    return max(0, (prompt_tokens - 1) // block_size)


def leading(hashes: Sequence[BlockHash], present: Container[BlockHash]) -> int:
    """How many of `hashes`, from the first, are all in `present` (a cache hit is a prefix:
    it stops at the first block not cached)."""
    n = 0
    for h in hashes:
        if h not in present:
            break
        n += 1
    return n


class PrefixIndex:
    """What each engine is expected to hold in its prefix cache: the block hashes of the
    prompts routed there, LRU, at most `capacity(engine)` per engine and `max_entries` in all.

    Mutable; one per gateway process. Memory: about 150 bytes per entry (an 8-byte hash in an
    ordered dict; 146 measured, docs/benchmarks.md)."""

    def __init__(self, max_entries: int = 1_000_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._engines: dict[str, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[str, int] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def held(self, engine: str) -> int:
        """Hashes recorded for `engine`."""
        return len(self._engines.get(engine, ()))

    def set_capacity(self, engine: str, blocks: int) -> None:
        """The engine holds at most `blocks` blocks: it cannot cache more (oldest go)."""
        self._capacity[engine] = max(0, blocks)
        self._trim(engine)

    def cached(self, engine: str, hashes: Sequence[BlockHash]) -> int:
        """Blocks of `hashes`, from the first, the engine is expected to have cached."""
        held = self._engines.get(engine)
        return 0 if held is None else leading(hashes, held)

    def record(self, engine: str, hashes: Sequence[BlockHash]) -> None:
        """A prompt with these block hashes was sent to `engine`: they are now its most
        recently used (vLLM caches a running request's full blocks)."""
        if not hashes:
            return
        held = self._engines.setdefault(engine, OrderedDict())
        for h in hashes:
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                self._size += 1
        self._trim(engine)
        while self._size > self.max_entries:
            largest = max(self._engines.values(), key=len)
            largest.popitem(last=False)
            self._size -= 1

    def remove(self, engine: str, hashes: Sequence[BlockHash]) -> int:
        """The engine evicted these blocks (its KV events said so); returns how many of them
        were recorded."""
        held = self._engines.get(engine)
        if held is None:
            return 0
        gone = 0
        for h in hashes:
            if h in held:
                del held[h]
                gone += 1
        self._size -= gone
        return gone

    def hashes(self, engine: str) -> list[BlockHash]:
        """The hashes recorded for `engine`, least recently used first."""
        return list(self._engines.get(engine, ()))

    def forget(self, engine: str) -> None:
        """The engine restarted (or was reconfigured): its cache is empty."""
        held = self._engines.pop(engine, None)
        if held is not None:
            self._size -= len(held)

    def _trim(self, engine: str) -> None:
        held = self._engines.get(engine)
        limit = self._capacity.get(engine)
        if held is None or limit is None:
            return
        while len(held) > limit:
            held.popitem(last=False)
            self._size -= 1


class PrefixHolds:
    """Which prefix blocks the gateway's live leases hold on each engine, reference counted.

    vLLM shares a cached full block between every running request whose prompt starts with
    it; a block referenced by a running request is in use, one nobody references is free
    (`vllm:kv_cache_usage_perc` counts it free). So a new request's footprint on an engine may
    be *credited* only with the leading blocks of its prompt that a live lease there already
    holds (`leading`): those are in use whatever it does, and it takes them without new
    memory. Crediting blocks that are merely cached would under-count, because admitting the
    request turns them from free into used.

    The ledger counts each held block once, for as long as some lease holds it: an engine's
    reserved blocks are the leases' private blocks plus `shared(engine)`, the distinct held
    hashes. A lease holding `k` prefix hashes with a footprint of `T` blocks is private for
    `T − k` (the rest of its prompt and its output, and the copies of a fan-out `n > 1`, which
    vLLM shares but the gateway keeps counting: a safe error) and shares `k`; admitting it
    costs `T − leading` (`hold` returns how many of its hashes were new), releasing it gives
    back `T − k` and whatever its `drop` frees (the hashes no other lease holds).

    A lease holds a prefix-closed run of hashes (its prompt's first `k` blocks), so the held
    hashes of an engine are a union of such runs: a held hash's parents are held too, and
    `leading` is where the first unheld hash is.

    Pure and mutable: one per in-process store (the Redis store keeps the same counts in a
    hash per engine, `gateway/state/lua/`).
    """

    def __init__(self) -> None:
        self._counts: dict[str, dict[BlockHash, int]] = {}
        # The engines holding each lease's first hash: where `leading` may be above 0
        # (a held hash's parents are held too), found without visiting every engine.
        self._first: dict[BlockHash, set[str]] = {}

    def holders(self, hashes: Sequence[BlockHash]) -> frozenset[str]:
        """The engines where `leading(engine, hashes)` may be above 0."""
        if not hashes:
            return frozenset()
        return frozenset(self._first.get(hashes[0], ()))

    def leading(self, engine: str, hashes: Sequence[BlockHash]) -> int:
        """How many of `hashes`, from the first, live leases on `engine` hold."""
        counts = self._counts.get(engine)
        return 0 if counts is None else leading(hashes, counts)

    def hold(self, engine: str, hashes: Sequence[BlockHash]) -> int:
        """A lease on `engine` holds `hashes` now; returns how many no lease held before."""
        if not hashes:
            return 0
        counts = self._counts.setdefault(engine, {})
        self._first.setdefault(hashes[0], set()).add(engine)
        new = 0
        for h in hashes:
            held = counts.get(h, 0)
            counts[h] = held + 1
            new += held == 0
        return new

    def drop(self, engine: str, hashes: Sequence[BlockHash]) -> int:
        """A lease that held `hashes` on `engine` ended; returns how many no lease holds now.
        Dropping what was never held is a programming error (ValueError)."""
        counts = self._counts.get(engine)
        freed = 0
        for h in hashes:
            held = 0 if counts is None else counts.get(h, 0)
            if held <= 0 or counts is None:
                raise ValueError(f"prefix block {h.hex()} is not held on engine {engine!r}")
            if held == 1:
                del counts[h]
                freed += 1
            else:
                counts[h] = held - 1
        if hashes and (counts is None or hashes[0] not in counts):
            first = self._first.get(hashes[0])
            if first is not None:
                first.discard(engine)
                if not first:
                    del self._first[hashes[0]]
        if counts is not None and not counts:
            del self._counts[engine]
        return freed

    def shared(self, engine: str) -> int:
        """Distinct prefix blocks live leases hold on `engine` (each counted once)."""
        return len(self._counts.get(engine, ()))
