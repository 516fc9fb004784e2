"""Every routing scorer in both stores (issue 39): a scorer added to `SCORERS`
(gateway/core/routing.py) is found here when its Lua twin is missing or scores otherwise,
and either keeps the stores' ordered path (grouped asks decided from the engine order,
docs/engine-index.md), deciding as scoring every engine would, or is named here as one
that does not.

The scorer lists tried are derived from the registry: every one of one or two scorers
whose ranking the engine order gives (`ordered_ranking`), and every one it does not give.
"""

from __future__ import annotations

import itertools
import random
import re
import statistics
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.core.routing import SCORERS, Candidate, Router, fits, ordered_ranking
from gateway.core.types import EngineLoad, EngineSpec, EngineView, Footprint
from gateway.state.base import AdmissionAsk, Lease, Refusal
from gateway.state.engines import EngineBook
from gateway.state.memory import InMemoryStore
from gateway.state.redis import LUA_DIR, RedisStore
from tests.redis_server import redis_url
from tests.state.conftest import drop_keys, new_prefix
from tests.state.test_engine_groups import SPECS, _stores, drive, op, untimed_op
from tests.state.test_redis_engine_groups import _close, _grouped_and_scored

# Scorers that lose the ordered path wherever they are configured, and why. A scorer
# registered without `ordered_by` must be named here (a deliberate choice: grouped asks are
# then expanded and every engine scored), or declare the key of the order it ranks by.
WITHOUT_ORDERED_PATH = {
    "lowest_kv_fraction": "ranks by the share of an engine's capacity in use, not free blocks",
}

LISTS = [(name,) for name in sorted(SCORERS)] + list(itertools.permutations(sorted(SCORERS), 2))
ORDERED = [s for s in LISTS if ordered_ranking(s) is not None]
UNORDERED = [s for s in LISTS if ordered_ranking(s) is None]
ENGINES = 40  # in one group, for the counts of the ordered path's work


# The Lua twin: admit.lua's `score_of`, by which the Redis store scores.


def lua_scorers() -> set[str]:
    """The scorers admit.lua's `score_of` has a branch for."""
    text = (LUA_DIR / "admit.lua").read_text()
    found = re.search(r"\n  local function score_of\(.*?\n  end\n", text, re.DOTALL)
    assert found, "admit.lua has no `score_of`"
    return set(re.findall(r"name == '(\w+)'", found.group(0)))


def test_every_scorer_has_its_lua_twin() -> None:
    """The Redis store scores in admit.lua's `score_of`: a scorer registered without its
    branch there would fail every admission on Redis (`unknown scorer`)."""
    twins = lua_scorers()
    assert set(SCORERS) - twins == set(), "registered, no branch in admit.lua `score_of`"
    assert twins - set(SCORERS) == set(), "a branch in admit.lua `score_of`, not registered"


def _random_candidates(rng: random.Random) -> tuple[Candidate, ...]:
    """Two to five engines of a few sizes and loads, so that scores often tie; a footprint
    on each, mostly the same one, some with blocks cached."""
    out, blocks = [], rng.randint(1, 4)
    for i in range(rng.randint(2, 5)):
        spec = EngineSpec(f"e{i}", "", frozenset({"m"}), rng.choice((9, 13, 17)), 16, 4, 4096)
        healthy = rng.random() < 0.9
        view = EngineView(spec, EngineLoad(), healthy, rng.choice((0, 2, 4, 6)), rng.randint(0, 4))
        need = rng.choice((blocks, blocks, rng.randint(1, 4)))
        out.append(Candidate(view, Footprint(need, 1, 64, cached=rng.choice((0, 0, 0, 1, 2)))))
    return tuple(out)


@pytest.mark.redis
@pytest.mark.parametrize("name", sorted(SCORERS))
async def test_the_lua_twin_ranks_engines_as_the_scorer(name: str, prefix: str) -> None:
    """admit.lua's `score_of` against the Python scorer, alone, on random engines (sizes,
    foreign load, health, footprints, cached blocks, cached block weights): the script
    chooses exactly the engine `Router.pick` would, its last tie broken by the store's seed
    (`seed % ties`, the ties in candidate order) — so the Lua ranks, and ties, as Python."""
    rng = random.Random(name)
    for weight in (0.0, 1.0, 4.0):
        router = Router((name,), cached_block_weight=weight)
        store = RedisStore(
            redis_url(),
            (name,),
            replica_id="a",
            key_prefix=prefix,
            seed=7,
            cached_block_weight=weight,
            headroom=0.0,
        )
        seeds = random.Random(7)  # the store's tie-break seeds, drawn one per call
        try:
            for i in range(60):
                candidates = _random_candidates(rng)
                got = await store.try_admit(AdmissionAsk(f"a{i}", candidates, 1.0))
                seed = seeds.randrange(2**31)
                scored = [(router.score(c, 1.0), c) for c in candidates if fits(c, 1.0)]
                if not scored:
                    assert got == Refusal("no_capacity")
                    continue
                best = max(score for score, _ in scored)
                ties = [c.view.spec.name for score, c in scored if score == best]
                assert isinstance(got, Lease), (got, scored)
                assert got.engine == ties[seed % len(ties)], (got.engine, scored)
                await store.release(got)
        finally:
            await store.close()
            await drop_keys(prefix)


# The ordered path: kept by the scorers that name a key of the engine order.


def test_each_scorer_keeps_the_ordered_path_or_is_named_as_not() -> None:
    """The lists that keep the ordered path cover every scorer but those named above."""
    kept = {name for scorers in ORDERED for name in scorers}
    declared = {name for name, s in SCORERS.items() if s.ordered_by is None}
    assert declared == set(WITHOUT_ORDERED_PATH), (
        "a scorer without `ordered_by` loses the ordered path: name it in "
        "WITHOUT_ORDERED_PATH with the reason, or declare the order's key it ranks by"
    )
    assert kept == set(SCORERS) - declared, kept


class CountingRouter(Router):
    """A router that counts the engines it scores."""

    scored = 0

    def score(self, candidate: Candidate, kv_ceiling: float) -> tuple[float, ...]:
        self.scored += 1
        return super().score(candidate, kv_ceiling)


def _engines(n: int = ENGINES) -> list[EngineSpec]:
    """`n` engines of distinct sizes: the last has the most free blocks."""
    return [EngineSpec(f"e{i:03}", "", frozenset({"m"}), 100 + i, 16, 8, 4096) for i in range(n)]


async def _scored_per_grouped_ask(scorers: tuple[str, ...]) -> int:
    router = CountingRouter(scorers)
    store = InMemoryStore(router, random.Random(0))
    specs = _engines()
    await store.set_views([EngineView(s, EngineLoad()) for s in specs])
    await store.set_group("m", frozenset(s.name for s in specs), 1.0)
    got = await store.try_admit(AdmissionAsk("a", group="m", need=Footprint(4, 1, 64)))
    assert isinstance(got, Lease), got
    return router.scored


@pytest.mark.parametrize("scorers", ORDERED, ids="+".join)
async def test_the_ordered_path_scores_one_engine_not_all(scorers: tuple[str, ...]) -> None:
    """Kept: the order hands the router its first engine, and no other is scored."""
    assert await _scored_per_grouped_ask(scorers) == 1


@pytest.mark.parametrize("scorers", UNORDERED, ids="+".join)
async def test_without_the_ordered_path_every_engine_is_scored(scorers: tuple[str, ...]) -> None:
    """Not kept (`WITHOUT_ORDERED_PATH`, or scorers in another order than the order's
    keys): the grouped ask is expanded and every engine scored."""
    assert await _scored_per_grouped_ask(scorers) == ENGINES


@pytest.mark.parametrize("scorers", ORDERED, ids="+".join)
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=80), headroom=st.sampled_from((0.0, 0.2, 0.5)))
async def test_the_ordered_path_decides_as_scoring_every_engine(
    scorers: tuple[str, ...], ops: list[tuple[Any, ...]], headroom: float
) -> None:
    """As `test_engine_groups` for the scorers it names, for every list kept here."""
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    scored, grouped, book = await _stores(scorers, headroom, views)
    await drive(scored, grouped, book, views, ops, clock=scored._clock)


def _tied_views() -> dict[str, EngineView]:
    """Engines alike in free blocks, each with another number of sequences running (the
    fewest on t3): a ranking by free blocks alone leaves them all tied, one by free blocks
    then running sequences does not."""
    views = {}
    for i, running in enumerate((3, 1, 4, 0, 5, 2)):
        spec = EngineSpec(f"t{i}", "", frozenset({"m"}), 33, 16, 8, 4096)
        views[spec.name] = EngineView(spec, EngineLoad(), foreign_seqs=running)
    return views


def _tie_choices_expected(scorers: tuple[str, ...], chosen: set[str]) -> None:
    """The tied engines were told apart as the scorers tell them apart."""
    if ordered_ranking(scorers) == "running":
        assert chosen == {"t3"}, chosen
    else:
        assert len(chosen) > 1, chosen  # the seeded choice among all of them


@pytest.mark.parametrize("scorers", ORDERED, ids="+".join)
async def test_the_ordered_path_breaks_ties_as_the_scorers_do(scorers: tuple[str, ...]) -> None:
    """Down to the key the scorers name (`ordered_by`): ties in free blocks broken by
    running sequences, or left to the seeded choice, as scoring every engine does."""
    views = _tied_views()
    book = EngineBook()
    book.set_views(views.values())
    book.set_group("m", frozenset(views), 1.0)
    chosen = set()
    for seed in range(8):
        scored = InMemoryStore(Router(scorers), random.Random(seed))
        grouped = InMemoryStore(Router(scorers), random.Random(seed))
        await grouped.set_views(list(views.values()))
        await grouped.set_group("m", frozenset(views), 1.0)
        ask = AdmissionAsk("a", group="m", need=Footprint(4, 1, 64))
        got = await grouped.try_admit(ask)
        assert got == await scored.try_admit(book.expand(ask))
        assert isinstance(got, Lease)
        chosen.add(got.engine)
    _tie_choices_expected(scorers, chosen)


# On Redis (the test session's real server).


async def _commands(client: aioredis.Redis) -> dict[str, int]:
    """Commands Redis ran so far, by name (a script's own commands counted there too)."""
    stats = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


async def _commands_per_grouped_ask(scorers: tuple[str, ...], engines: int) -> float:
    """Redis commands per admission of a grouped ask (the lease released uncounted)."""
    prefix = new_prefix()
    store = RedisStore(
        redis_url(), scorers, replica_id="a", key_prefix=prefix, seed=0, order_min_engines=1
    )
    client = aioredis.from_url(redis_url())
    try:
        specs = _engines(engines)
        await store.set_views([EngineView(s, EngineLoad()) for s in specs])
        await store.set_group("m", frozenset(s.name for s in specs), 1.0)
        counts = []
        for i in range(3):
            before = await _commands(client)
            got = await store.try_admit(AdmissionAsk(f"a{i}", group="m", need=Footprint(4, 1, 64)))
            ran = {k: n - before.get(k, 0) for k, n in (await _commands(client)).items()}
            assert ran.get("fcall", 0) + ran.get("evalsha", 0) == 1, ran  # this call alone
            counts.append(sum(n for k, n in ran.items() if k not in ("info", "fcall", "evalsha")))
            assert isinstance(got, Lease), got
            await store.release(got)
        return statistics.mean(counts)
    finally:
        await store.close()
        await client.aclose()
        await drop_keys(prefix)


@pytest.mark.redis
@pytest.mark.parametrize("scorers", ORDERED, ids="+".join)
async def test_the_ordered_path_on_redis_does_not_read_every_engine(
    scorers: tuple[str, ...],
) -> None:
    """Kept on Redis too (admit.lua `ordered`, told by ARGV 17): the commands of an
    admission do not grow with the engines (measured: the same at 4 and at 40)."""
    small = await _commands_per_grouped_ask(scorers, 4)
    large = await _commands_per_grouped_ask(scorers, ENGINES)
    assert large - small < (ENGINES - 4) / 2, (small, large)


@pytest.mark.redis
@pytest.mark.parametrize("scorers", UNORDERED, ids="+".join)
async def test_without_the_ordered_path_redis_reads_every_engine(
    scorers: tuple[str, ...],
) -> None:
    """Not kept: every engine's view is read (one HGET each) and scored."""
    small = await _commands_per_grouped_ask(scorers, 4)
    large = await _commands_per_grouped_ask(scorers, ENGINES)
    assert large - small >= ENGINES - 4, (small, large)


@pytest.mark.redis
@pytest.mark.parametrize("scorers", ORDERED, ids="+".join)
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(untimed_op, min_size=20, max_size=60), headroom=st.sampled_from((0.0, 0.2, 0.5))
)
async def test_the_ordered_path_on_redis_decides_as_scoring_every_engine(
    scorers: tuple[str, ...], ops: list[tuple[Any, ...]], headroom: float
) -> None:
    """As `test_redis_engine_groups` for the scorers it names, for every list kept here."""
    views = {s.name: EngineView(s, EngineLoad(), staged_seqs=1) for s in SPECS}
    scored, grouped, book, prefixes = await _grouped_and_scored(scorers, headroom, views)
    try:
        await drive(scored, grouped, book, views, ops, clock=None, tolerance=0.5)
    finally:
        await _close((scored, grouped), prefixes)


@pytest.mark.redis
@pytest.mark.parametrize("scorers", ORDERED, ids="+".join)
async def test_the_ordered_path_on_redis_breaks_ties_as_the_scorers_do(
    scorers: tuple[str, ...],
) -> None:
    """As `test_the_ordered_path_breaks_ties_as_the_scorers_do`, told by ARGV 17."""
    views = _tied_views()
    chosen = set()
    for seed in range(8):
        scored, grouped, book, prefixes = await _grouped_and_scored(
            scorers, 0.0, views, {"m": frozenset(views)}, seed=seed
        )
        try:
            ask = AdmissionAsk("a", group="m", need=Footprint(4, 1, 64))
            got = await grouped.try_admit(ask)
            assert got == await scored.try_admit(book.expand(ask))
            assert isinstance(got, Lease)
            chosen.add(got.engine)
            await grouped.release(got)
            await scored.release(got)
        finally:
            await _close((scored, grouped), prefixes)
    _tie_choices_expected(scorers, chosen)
