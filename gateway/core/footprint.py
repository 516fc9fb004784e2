"""KV footprint of a request: tokens → blocks, per engine.

A sequence holds `ceil(tokens / block_size)` blocks when it has `tokens` tokens; at worst it
reaches prompt + max output. With `n > 1` (or several prompts) vLLM v1 runs one sequence per
choice, each with its own copy of the prompt: we count each sequence's prompt in full. With
prefix caching vLLM may share the prompt's *full* blocks between those sequences, so this
over-counts by at most `(n − 1) × floor(prompt / block_size)` blocks — a safe error.
"""

from __future__ import annotations

from gateway.core.kvmath import ceil_div
from gateway.core.types import Footprint, RequestShape

__all__ = ["ceil_div", "context_overflow", "footprint", "output_budget"]


def output_budget(
    prompt_tokens: int,
    requested: int | None,
    max_model_len: int,
    default: int | None = None,
    *,
    clamp: bool = False,
) -> int:
    """The most tokens one sequence may generate: what was asked (with `clamp`, at most what
    the context leaves, as vLLM 0.32 runs it); else the engine's default (vLLM's completions:
    16) clamped to what the context allows; else all it allows."""
    room = max(0, max_model_len - prompt_tokens)
    if requested is not None:
        return min(requested, room) if clamp else requested
    return room if default is None else min(default, room)


def footprint(
    shape: RequestShape,
    block_size: int,
    max_model_len: int,
    output_cap: int | None = None,
    *,
    clamp: bool = False,
) -> Footprint:
    """Blocks, sequences and tokens of `shape` on an engine of that geometry.

    Blocks hold the worst case (prompt + the whole output budget) unless `output_cap` limits
    the output each sequence is reserved for (the `predicted` reservation); tokens are
    always the worst case (what TPM charges up front). `clamp`: an output budget longer than
    the context leaves is cut to what it leaves (`admission.over_length: clamp`).
    """
    blocks = 0
    tokens = 0
    prompt_blocks = 0
    for prompt in shape.prompt_tokens:
        budget = 0
        if shape.generates:
            budget = output_budget(
                prompt,
                shape.max_output_tokens,
                max_model_len,
                shape.default_output_tokens,
                clamp=clamp,
            )
        reserved = budget if output_cap is None else min(budget, output_cap)
        tokens += shape.n * (prompt + budget)
        if shape.holds_kv:
            blocks += shape.n * ceil_div(prompt + reserved, block_size)
            prompt_blocks += shape.n * ceil_div(prompt, block_size)
    seqs = shape.n * len(shape.prompt_tokens)
    return Footprint(blocks=blocks, seqs=seqs, tokens=tokens, prompt_blocks=prompt_blocks)


def context_overflow(shape: RequestShape, max_model_len: int, *, clamp: bool = False) -> str | None:
    """Why `shape` can never run under `max_model_len`, in vLLM's words; None when it can.

    Refused in every mode: a prompt that leaves no room for output. Without `clamp` (the
    `refuse` policy, as most vLLM versions and OpenAI): prompt + max_tokens beyond the
    context. With `clamp` (vLLM 0.32's behaviour, the default): only a `max_tokens` larger
    than the whole context, which vLLM 0.32 refuses too; a smaller one is cut to what fits.
    """
    for prompt in shape.prompt_tokens:
        if not shape.generates:
            if prompt > max_model_len:
                return (
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"your input contains {prompt} tokens."
                )
            continue
        if prompt >= max_model_len:
            return (
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt contains {prompt} input tokens, which leaves no room for output."
            )
        requested = shape.max_output_tokens
        if requested is None:
            continue
        if clamp and requested > max_model_len:
            return (
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                f"model's maximum context length is {max_model_len} tokens."
            )
        if not clamp and prompt + requested > max_model_len:
            return (
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {requested} output tokens and your prompt contains {prompt} input "
                f"tokens, for a total of {prompt + requested} tokens. Please reduce the length "
                f"of the input prompt or the number of requested output tokens."
            )
    return None
