"""The token counter protocol, and what every counter shares: off-loop counting of large inputs
and the completions ``prompt`` forms."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

from gateway.tokens.chat import ChatInput
from gateway.tokens.count import TokenCount
from gateway.tokens.errors import PromptTypeError

T = TypeVar("T")

OFFLOAD_CHARS = 8 * 1024
"""Inputs longer than this many characters are tokenized in a worker thread. Measured on the
2-core test machine (docs/tokens.md): 4 KiB takes ~0.5-1.2 ms with ``hf``, 64 KiB ~20 ms, so
8 KiB keeps an inline stall of the event loop at about 2 ms, while a thread hop costs 0.1-0.4 ms."""


@runtime_checkable
class TokenCounter(Protocol):
    """Counts prompt tokens of one model as its engine will see them.

    ``count_prompt`` is a completions prompt (text as sent, the tokenizer's own BOS/EOS added
    if it adds any); ``count_chat`` is the chat prompt after the chat template, rendered with
    the request's tools and template options (:class:`ChatInput`), each media part counted as
    ``chat.media`` says (the ``engine`` counter asks the engine instead). Both return a
    :class:`TokenCount` (count ≥ 0, ids where ``gives_ids``) and raise only
    :class:`gateway.tokens.TokenCountError` subclasses (``ValueError`` ones when the input is
    at fault).
    """

    name: str
    gives_ids: bool
    """Whether counts carry the prompt's token ids (``hf:`` and ``engine``: text prompts)."""

    async def count_prompt(self, prompt: str) -> TokenCount: ...

    async def count_chat(self, chat: ChatInput) -> TokenCount: ...


async def count_off_loop(count: Callable[[], T], size: int) -> T:
    """Run the CPU-bound ``count`` inline when ``size`` (characters) is small, else in a worker
    thread so the event loop keeps serving other requests."""
    if size > OFFLOAD_CHARS:
        return await asyncio.to_thread(count)
    return count()


async def prompt_token_counts(counter: TokenCounter, prompt: object) -> list[TokenCount]:
    """Prompt tokens of each prompt of a ``/v1/completions`` request, in order.

    ``prompt`` may be a string, a non-empty list of strings, a non-empty list of token ids, or
    a non-empty list of non-empty token-id lists (ids are counted by length, not checked
    against a vocabulary). Anything else raises :class:`PromptTypeError` (a ``ValueError``).
    """
    if isinstance(prompt, str):
        return [await counter.count_prompt(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise PromptTypeError(_prompt_type_message(prompt))
    if all(isinstance(p, str) for p in prompt):
        return list(await asyncio.gather(*(counter.count_prompt(p) for p in prompt)))
    if all(_is_token_id(t) for t in prompt):
        return [TokenCount.of_ids(prompt)]
    if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        return [TokenCount.of_ids(p) for p in prompt]
    raise PromptTypeError(_prompt_type_message(prompt))


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _prompt_type_message(prompt: object) -> str:
    if isinstance(prompt, list) and not prompt:
        what = "an empty list"
    else:
        what = f"a {type(prompt).__name__}"
        if isinstance(prompt, list):
            kinds = sorted({type(p).__name__ for p in prompt})
            what += f" of {', '.join(kinds)}"
    return (
        "'prompt' must be a string, a list of strings, a list of token ids (non-negative "
        f"integers) or a list of non-empty token-id lists; got {what}"
    )
