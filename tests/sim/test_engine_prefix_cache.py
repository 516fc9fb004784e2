"""Automatic prefix caching in the pure engine (vLLM v1's kv_cache_manager / block_pool)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sim.block_pool import hash_block
from gateway.sim.engine import Engine, EngineLimits, RequestSpec, StepTiming

BS = 4  # block size of these tests


def _engine(num_gpu_blocks: int = 17, caching: bool = True, **kw: int) -> Engine:
    limits = EngineLimits(
        num_gpu_blocks=num_gpu_blocks,
        block_size=BS,
        max_num_seqs=kw.pop("max_num_seqs", 8),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64),
        max_model_len=kw.pop("max_model_len", 32),
        enable_prefix_caching=caching,
    )
    assert not kw
    return Engine(limits, StepTiming(1.0, 1.0, 0.0))


def _spec(rid: str, prompt: Sequence[int], output: int = 2, salt: str | None = None) -> RequestSpec:
    # Output ids unique per request id, so only prompts are shared unless a test says so.
    out = [1000 + zlib.crc32(rid.encode()) % 100_000 * 10 + i for i in range(output)]
    return RequestSpec.of_tokens(rid, prompt, out, cache_salt=salt)


def _run(engine: Engine, now: float = 0.0) -> float:
    while engine.has_work():
        now = engine.step(now).batch.ends_at
    return now


def _served(engine: Engine, spec: RequestSpec, now: float) -> tuple[int, float]:
    """Add ``spec``, run the engine idle; (its cached prompt tokens, the clock after)."""
    engine.add(spec, now)
    cached = None
    while engine.has_work():
        outcome = engine.step(now)
        now = outcome.batch.ends_at
        for f in outcome.finished:
            if f.request_id == spec.request_id:
                cached = f.num_cached_tokens
    assert cached is not None
    return cached, now


def _view(engine: Engine, rid: str) -> tuple[int, tuple[int, ...]]:
    (view,) = [v for v in engine.requests() if v.request_id == rid]
    return view.num_cached_tokens, view.block_ids


def test_a_repeated_prompt_hits_and_skips_the_cached_tokens() -> None:
    engine = _engine()
    prompt = list(range(10, 20))  # 10 tokens: 2 full blocks
    engine.add(_spec("a", prompt), 0.0)
    first = engine.begin_step(0.0)
    assert first.prefill_tokens == 10
    engine.end_step(first)
    now = _run(engine, first.ends_at)

    engine.add(_spec("b", prompt), now)
    batch = engine.begin_step(now)
    assert _view(engine, "b")[0] == 8  # two blocks of 4 found in the cache
    assert batch.scheduled == (("b", 2),) and batch.prefill_tokens == 2
    # --prefill-ms-per-token applies to the computed tokens only (1 ms each here).
    assert batch.seconds == pytest.approx((2 * 1.0 + 1.0) / 1000)
    engine.end_step(batch)
    _run(engine, batch.ends_at)
    snap = engine.snapshot()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (20, 8)
    assert snap.prompt_tokens == 20 and snap.prompt_tokens_cached == 8


@pytest.mark.parametrize(
    ("prompt_len", "hit_tokens"),
    [(3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12)],
)
def test_at_least_the_last_token_is_computed(prompt_len: int, hit_tokens: int) -> None:
    """A full hit is capped at (prompt - 1) // block_size blocks."""
    engine = _engine()
    prompt = list(range(50, 50 + prompt_len))
    engine.add(_spec("a", prompt), 0.0)
    now = _run(engine)
    engine.add(_spec("b", prompt), now)
    batch = engine.begin_step(now)
    assert _view(engine, "b")[0] == hit_tokens
    assert batch.scheduled == (("b", prompt_len - hit_tokens),)


def test_concurrent_requests_with_a_shared_prefix_share_blocks() -> None:
    engine = _engine()
    shared = list(range(100, 108))  # 2 full blocks
    engine.add(_spec("a", [*shared, 1, 2, 3]), 0.0)
    engine.add(_spec("b", [*shared, 7, 8, 9, 6, 5]), 0.0)
    engine.begin_step(0.0)
    # vLLM caches a block when it is allocated, so b hits a's blocks in the same step.
    a_cached, a_blocks = _view(engine, "a")
    b_cached, b_blocks = _view(engine, "b")
    assert (a_cached, b_cached) == (0, 8)
    assert a_blocks[:2] == b_blocks[:2]
    assert engine.used_blocks == 3 + 4 - 2 < len(a_blocks) + len(b_blocks)
    assert engine.block_pool.ref_count(a_blocks[0]) == 2
    engine.block_pool.audit()


def test_n_sequences_of_one_prompt_share_its_full_blocks() -> None:
    engine = _engine()
    prompt = list(range(200, 213))  # 13 tokens: 3 full blocks
    for j in range(3):
        engine.add(_spec(f"c-{j}", prompt), 0.0)
    engine.begin_step(0.0)
    assert [_view(engine, f"c-{j}")[0] for j in range(3)] == [0, 12, 12]
    assert engine.used_blocks == 4 + 1 + 1


def test_a_cache_salt_isolates_requests() -> None:
    prompt = list(range(10, 19))
    for salts, expected in (
        (("tenant-1", "tenant-2"), 0),
        (("tenant-1", None), 0),
        ((None, "tenant-1"), 0),
        (("tenant-1", "tenant-1"), 8),
        ((None, None), 8),
    ):
        engine = _engine()
        _, now = _served(engine, _spec("a", prompt, salt=salts[0]), 0.0)
        cached, _ = _served(engine, _spec("b", prompt, salt=salts[1]), now)
        assert cached == expected, salts


def test_blocks_filled_by_generated_tokens_are_cached() -> None:
    engine = _engine()
    prompt = [1, 2, 3]
    out = list(range(500, 510))
    engine.add(RequestSpec.of_tokens("a", prompt, out), 0.0)
    now = _run(engine)
    # KV of 12 tokens was computed (the last sampled token never is): 3 full blocks, the
    # last two made of generated tokens only.
    assert engine.block_pool.num_cached == 3
    engine.add(RequestSpec.of_tokens("b", [*prompt, *out], [7]), now)
    engine.begin_step(now)
    assert _view(engine, "b")[0] == 12


def test_eviction_is_lru_and_a_requests_tail_goes_before_its_prefix() -> None:
    engine = _engine(num_gpu_blocks=9, max_model_len=32)  # 8 usable blocks
    p1 = list(range(10, 19))  # 9 tokens, 3 blocks while it runs
    p2 = list(range(30, 39))
    engine.add(_spec("p1", p1, output=1), 0.0)
    now = _run(engine)
    engine.add(_spec("p2", p2, output=1), now)
    now = _run(engine, now)
    pool = engine.block_pool
    # Both finished: 4 full blocks cached (2 each), all free; 8 - 6 never-used blocks first.
    assert pool.num_used == 0 and pool.num_cached == 4
    assert engine.kv_cache_usage() == 0.0  # cached but unreferenced blocks count as free
    never_used, p1_partial, p1_second = (7, 8), 3, 2
    assert pool.free_queue()[:4] == (*never_used, p1_partial, p1_second)
    # A request needing 4 new blocks takes the 2 never-used ones, then p1's blocks tail
    # first (p1 was freed before p2): its uncached partial block, then its second block.
    engine.add(_spec("x", list(range(60, 73)), output=1), now)  # 13 tokens: 4 blocks
    batch = engine.begin_step(now)
    assert _view(engine, "x")[1] == (*never_used, p1_partial, p1_second)
    now = _run(engine, engine.end_step(batch).batch.ends_at)
    p1_hashes = [hash_block(None, p1[:4]), hash_block(hash_block(None, p1[:4]), p1[4:8])]
    p2_hashes = [hash_block(None, p2[:4]), hash_block(hash_block(None, p2[:4]), p2[4:8])]
    assert pool.longest_hit(p1_hashes) == [1]  # p1 lost its second block only
    assert len(pool.longest_hit(p2_hashes)) == 2  # p2, freed later, is intact
    engine.add(_spec("q1", p1, output=1), now)
    engine.begin_step(now)
    assert _view(engine, "q1")[0] == 4


def test_a_full_cache_evicts_before_anything_is_preempted() -> None:
    engine = _engine(num_gpu_blocks=9, max_model_len=32)  # 8 usable
    for i in range(4):  # 4 prompts of 2 full blocks: the whole cache ends up cached
        engine.add(_spec(f"old{i}", list(range(100 * i + 1, 100 * i + 9)), output=1), 0.0)
    now = _run(engine)
    assert engine.block_pool.num_evictable == 8 and engine.used_blocks == 0
    engine.add(_spec("big", list(range(900, 925)), output=6), now)  # grows to 8 blocks
    _run(engine, now)
    assert engine.num_preemptions == 0
    assert engine.snapshot().peak_used_blocks == 8


def test_preemption_frees_blocks_and_readmission_finds_them() -> None:
    engine = _engine(num_gpu_blocks=5, max_model_len=16)  # 4 usable
    engine.add(_spec("old", list(range(1, 8)), output=3), 0.0)  # 2 blocks, grows to 3
    engine.add(_spec("new", list(range(20, 27)), output=8), 0.0)  # 2 blocks, grows to 4
    now = 0.0
    while engine.num_preemptions == 0:
        now = engine.step(now).batch.ends_at
    (view,) = [v for v in engine.requests() if v.request_id == "new"]
    assert view.status == "preempted" and view.num_blocks == 0
    queries = engine.prefix_cache_queries
    while engine.snapshot().waiting:
        batch = engine.begin_step(now)
        readmitted = dict(batch.scheduled).get("new")
        now = engine.end_step(batch).batch.ends_at
        if readmitted is not None:
            break
    # "old" needed one block: the head of the free queue, new's tail block (freed first).
    # Re-admitted, "new" finds its first block and recomputes only the rest.
    assert view.num_tokens == 9 and readmitted == 9 - BS
    # vLLM does not count lookups of preempted requests in prefix_cache_queries.
    assert engine.prefix_cache_queries == queries
    _run(engine, now)
    assert engine.used_blocks == 0


def test_without_caching_nothing_is_shared_or_counted() -> None:
    engine = _engine(caching=False)
    prompt = list(range(10, 20))
    engine.add(_spec("a", prompt), 0.0)
    engine.add(_spec("b", prompt), 0.0)
    batch = engine.begin_step(0.0)
    assert batch.prefill_tokens == 20 and engine.used_blocks == 6
    _run(engine, engine.end_step(batch).batch.ends_at)
    engine.add(_spec("c", prompt), 1.0)
    assert engine.begin_step(1.0).prefill_tokens == 10
    snap = engine.snapshot()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits, snap.prompt_tokens_cached) == (
        0,
        0,
        0,
    )
    assert engine.block_pool.num_cached == 0


def test_specs_without_token_ids_share_nothing() -> None:
    engine = _engine()
    _, now = _served(engine, RequestSpec("a", 9, 2), 0.0)
    assert _served(engine, RequestSpec("b", 9, 2), now)[0] == 0


# -- invariants under any load ------------------------------------------------------------

_PREFIXES = [tuple(range(10, 26)), tuple(range(40, 46)), (7,) * 9]

_request = st.tuples(
    st.sampled_from(range(len(_PREFIXES))),  # shared prefix
    st.integers(0, 12),  # own suffix length
    st.integers(1, 20),  # output tokens
    st.floats(0, 0.1),  # arrival
    st.sampled_from([None, "s1"]),  # cache salt
    st.booleans(),  # aborted at some point
)


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(_request, min_size=1, max_size=20),
    num_gpu_blocks=st.integers(12, 40),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64),
)
def test_invariants_hold_with_shared_prefixes(
    requests: list[tuple[int, int, int, float, str | None, bool]],
    num_gpu_blocks: int,
    max_num_seqs: int,
    budget: int,
) -> None:
    limits = EngineLimits(
        num_gpu_blocks=num_gpu_blocks,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=40,
    )
    engine = Engine(limits, StepTiming(0.1, 1.0, 0.1))
    pool = engine.block_pool
    arrivals = []
    for i, (p, suffix, output, at, salt, aborted) in enumerate(requests):
        prompt = [*_PREFIXES[p], *range(300 + i * 20, 300 + i * 20 + suffix)]
        out = [900 + (i * 31 + j) % 50 for j in range(min(output, 40 - len(prompt)))]
        arrivals.append((at, RequestSpec.of_tokens(f"r{i}", prompt, out, cache_salt=salt), aborted))
    arrivals.sort(key=lambda a: a[0])
    pending = list(arrivals)
    ended: set[str] = set()
    now, steps = 0.0, 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= now:
            at, spec, _ = pending.pop(0)
            engine.add(spec, at)
        if not engine.has_work():
            now = pending[0][0]
            continue
        batch = engine.begin_step(now)
        pool.audit()  # counts >= 0; free exactly when unreferenced; cache map consistent
        views = engine.requests()
        held = [b for v in views for b in v.block_ids]
        assert sum(pool.ref_count(b) for b in set(held)) == len(held)
        assert all(len(set(v.block_ids)) == len(v.block_ids) for v in views)
        assert 0 <= engine.used_blocks == len(set(held)) <= limits.usable_blocks
        for v in views:
            assert v.num_blocks >= -(-v.num_computed_tokens // BS)
            assert v.num_blocks == 0 or v.status == "running"
        if steps % 3 == 0:
            for _, spec, aborted in arrivals:
                rid = spec.request_id
                if aborted and rid not in ended and engine.blocks_of(rid) is not None:
                    assert engine.abort(rid, now) is not None
                    ended.add(rid)
                    pool.audit()
        for f in engine.end_step(batch).finished:
            assert f.request_id not in ended
            ended.add(f.request_id)
        now = batch.ends_at
        steps += 1
        assert steps < 100_000
    assert ended == {spec.request_id for _, spec, _ in arrivals}
    assert engine.used_blocks == 0 and engine.kv_cache_usage() == 0.0
    assert all(pool.ref_count(b) == 0 for b in range(1, limits.usable_blocks + 1))
    pool.audit()
