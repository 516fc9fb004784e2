import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.footprint import ceil_div, context_overflow, footprint, output_budget
from gateway.core.types import RequestShape


@pytest.mark.parametrize(
    ("prompt", "max_out", "n", "block_size", "max_len", "blocks", "tokens"),
    [
        (10, 6, 1, 16, 2048, 1, 16),  # exactly one block
        (10, 7, 1, 16, 2048, 2, 17),  # one token over
        (20, 200, 1, 128, 512, 2, 220),  # the real-vLLM overload request
        (100, None, 1, 16, 512, 32, 512),  # omitted max_tokens → up to max_model_len
        (10, 6, 3, 16, 2048, 3, 48),  # n sequences, each with the full prompt
        (0, 1, 1, 16, 64, 1, 1),
    ],
)
def test_footprint_table(prompt, max_out, n, block_size, max_len, blocks, tokens):
    fp = footprint(RequestShape((prompt,), max_out, n), block_size, max_len)
    assert (fp.blocks, fp.tokens, fp.seqs) == (blocks, tokens, n)


def test_several_prompts_add_up():
    fp = footprint(RequestShape((10, 30), 10, 2), 16, 2048)
    assert fp.seqs == 4
    assert fp.blocks == 2 * ceil_div(20, 16) + 2 * ceil_div(40, 16)


@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_ceil_div_matches_math(a, b):
    assert ceil_div(a, b) == -(-a // b) == (a + b - 1) // b


@given(
    st.integers(0, 4096), st.one_of(st.none(), st.integers(1, 4096)), st.sampled_from([16, 32, 128])
)
def test_blocks_hold_every_token(prompt, max_out, block_size):
    """A sequence's blocks hold all its tokens, and one block fewer would not."""
    max_len = 8192
    fp = footprint(RequestShape((prompt,), max_out, 1), block_size, max_len)
    total = prompt + output_budget(prompt, max_out, max_len)
    assert fp.blocks * block_size >= total
    assert (fp.blocks - 1) * block_size < total or total == 0


def test_context_overflow_messages_carry_numbers():
    msg = context_overflow(RequestShape((3500,), 1000, 1), 4096)
    assert msg is not None and "4096" in msg and "3500" in msg and "1000" in msg and "4500" in msg
    assert context_overflow(RequestShape((3000,), 1000, 1), 4096) is None
    assert context_overflow(RequestShape((4096,), None, 1), 4096) is not None  # no room at all
    assert context_overflow(RequestShape((4000,), None, 1), 4096) is None


@pytest.mark.parametrize(
    ("prompt", "max_len", "budget"),
    [
        (100, 2048, 16),  # vLLM's completions default
        (2040, 2048, 8),  # clamped to what fits (vLLM does not refuse its own default)
        (2048, 2048, 0),
    ],
)
def test_an_engine_default_is_clamped_to_the_context(prompt, max_len, budget):
    assert output_budget(prompt, None, max_len, default=16) == budget
    shape = RequestShape((prompt,), None, 1, default_output_tokens=16)
    assert footprint(shape, 16, max_len).tokens == prompt + budget
    # What the client asked for explicitly wins over any default.
    assert output_budget(prompt, 5, max_len, default=16) == 5
    assert output_budget(prompt, None, max_len) == max_len - prompt


def test_over_long_max_tokens_is_clamped_to_what_fits_or_refused() -> None:
    over = RequestShape((3500,), 1000, 1)  # 3,500 + 1,000 > 4,096
    assert context_overflow(over, 4096, clamp=True) is None
    assert output_budget(3500, 1000, 4096, clamp=True) == 596
    assert footprint(over, 16, 4096, clamp=True).blocks == 256  # ceil(4,096 / 16)
    assert footprint(over, 16, 4096).blocks == ceil_div(4500, 16)  # refuse mode reserves all
    # vLLM 0.32 refuses a max_tokens beyond the whole context, clamp or not.
    huge = RequestShape((10,), 5000, 1)
    assert "too large: 5000" in (context_overflow(huge, 4096, clamp=True) or "")
    assert context_overflow(huge, 4096) is not None
    # A prompt that leaves no room is refused in both modes.
    assert context_overflow(RequestShape((4096,), 1, 1), 4096, clamp=True) is not None
