"""Prefix caching in the footprint: a request's prompt blocks as vLLM will hash them, what
each engine is expected to cache of them, and what the gateway has sent where.

The pure rules are in `gateway/core/prefix.py`; the store credits a footprint with the blocks
live leases hold (`PrefixHolds`), atomically with the admission. This module gives the
footprints what the store and routing need (`Footprint.prefix`, `Footprint.cached`) and keeps
this replica's `PrefixIndex` of what it sent to each engine, forgotten when an engine starts a
new epoch (restarted, or readmitted after an ejection: `EngineState.epoch`).

A footprint gets no prefix on an engine that does not cache prefixes
(`EngineSpec.prefix_caching`: off, or not known), and none when the gateway cannot tell what
vLLM would share: no token ids (`tiktoken:` and `estimate` counters, media in the prompt),
several prompts, a request that reads no cache (`prompt_logprobs`), a pooling request. The
hash chain includes what vLLM's includes besides the tokens: the model (a LoRA adapter is its
own model id) and the request's `cache_salt`.

Exact mode (`engines[].kv_events`): an engine that publishes its KV-cache events has its
index entries fed by them (`follow`, `events`: gateway/core/kv_events.py) instead of by what
this replica sent there, so they are what the engine reports it caches, from every client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.core.kv_events import EventBatch, EventFeed
from gateway.core.prefix import BlockHash, PrefixIndex, block_hashes, extra_for, hit_cap
from gateway.core.types import Footprint
from gateway.engines.pool import EnginePool


@dataclass(frozen=True, slots=True)
class Prompted:
    """A request's footprints with their prefixes, and the hashes of all its full prompt
    blocks per engine (what the engine caches once it has the request)."""

    needs: dict[str, Footprint]
    blocks: Mapping[str, tuple[BlockHash, ...]]


class PrefixCache:
    """Per replica. `credit`: footprints carry their prefix hashes, so the store can credit
    them (`prefix_cache.credit`); `index`: what engines are expected to cache, for routing
    (None: no index, `prefix_cache.index_entries` 0)."""

    def __init__(self, pool: EnginePool, *, credit: bool, index: PrefixIndex | None) -> None:
        self.pool = pool
        self.credit = credit
        self.index = index
        self._epochs: dict[str, int] = {}
        self._feeds: dict[str, EventFeed] = {}

    @property
    def enabled(self) -> bool:
        return self.credit or self.index is not None

    def footprints(
        self,
        needs: Mapping[str, Footprint],
        ids: Sequence[int] | None,
        *,
        model: str,
        salt: bytes | None,
    ) -> Prompted:
        """`needs` with each engine's prefix and expected cache hits for a prompt of `ids`
        (None: no prefix); `salt` None: the request reads no cache."""
        if not self.enabled or ids is None or salt is None or not ids:
            return Prompted(dict(needs), {})
        extra = extra_for(model, salt)
        by_size: dict[int, tuple[BlockHash, ...]] = {}
        out: dict[str, Footprint] = {}
        blocks: dict[str, tuple[BlockHash, ...]] = {}
        for name, need in needs.items():
            state = self.pool.get(name)
            if state is None or not state.spec.prefix_caching:
                out[name] = need  # an engine that does not cache shares no block
                continue
            size = state.spec.block_size
            full = by_size.get(size)
            if full is None:
                full = by_size[size] = tuple(block_hashes(ids, size, extra))
            prefix = full[: hit_cap(len(ids), size)]
            blocks[name] = full
            out[name] = replace(
                need,
                prefix=prefix if self.credit else (),
                cached=self._cached(name, prefix),
            )
        return Prompted(out, blocks)

    def sent(self, engine: str, blocks: Sequence[BlockHash]) -> None:
        """The request with these full prompt blocks goes to `engine`: it will cache them
        (an engine followed by its events says so itself)."""
        if self.index is not None and blocks and engine not in self._feeds:
            self._current(engine)
            self.index.record(engine, blocks)

    def follow(self, engine: str, model: str) -> None:
        """Feed `engine`'s index from its KV events, hashed for prompts of `model`."""
        state = self.pool.get(engine)
        if self.index is None or state is None:
            raise ValueError(f"no prefix index for engine {engine!r}")
        self._feeds[engine] = EventFeed(
            self.index,
            engine,
            model=model,
            block_size=state.spec.block_size,
            limit=state.spec.usable_blocks,
        )

    def events(self, engine: str, batch: EventBatch) -> None:
        """A batch of `engine`'s KV events arrived."""
        feed = self._feeds.get(engine)
        if feed is not None:
            self._current(engine)
            feed.apply(batch)

    def lost(self, engine: str) -> None:
        """`engine`'s events could not be read: what it caches is unknown from here on."""
        feed = self._feeds.get(engine)
        if feed is not None:
            feed.reset()

    def status(self, engine: str) -> dict[str, Any] | None:
        """`/admin/status`'s `prefix_index` of `engine`: the blocks it is expected to cache
        and, when its events are followed, what they did (None: no index)."""
        if self.index is None:
            return None
        feed = self._feeds.get(engine)
        return {
            "blocks": self.index.held(engine),
            "kv_events": None if feed is None else dataclasses.asdict(feed.counts),
        }

    def _cached(self, engine: str, prefix: Sequence[BlockHash]) -> int:
        if self.index is None or not prefix:
            return 0
        self._current(engine)
        return self.index.cached(engine, prefix)

    def _current(self, engine: str) -> None:
        """Forget what a restarted engine was expected to cache; bound its entries by its size."""
        assert self.index is not None
        state = self.pool.get(engine)
        if state is None:
            return
        seen = self._epochs.get(engine)
        if seen != state.epoch:
            if seen is not None:
                self.index.forget(engine)
                feed = self._feeds.get(engine)
                if feed is not None:
                    feed.restart()
            self._epochs[engine] = state.epoch
            self.index.set_capacity(engine, state.spec.usable_blocks)
