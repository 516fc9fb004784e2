"""Prompts of exact token lengths, built with the engine's own tokenizer.

The builder draws from a pool of *word tokens*: vocabulary entries that are one space-led word
(` the`, ` return`) which encode to exactly their own id, alone and repeated. A byte-level
tokenizer splits text into pre-tokens at such words before it merges anything, so a text of
`n` pool words is `n` tokens and two texts joined at a word never merge across the join —
which is why a shared prefix built from them ends on a boundary the suffix cannot change.
Every prompt is then counted the engine's way (`HfTokenizer`: completions with the
tokenizer's special tokens, chat through the chat template) and adjusted until the count is
the one asked for; `PromptError` if it cannot be (a length below the chat template's own
tokens, a tokenizer without word tokens).

Completions may instead send token ids (`token_ids=True`): vLLM counts a token-id prompt as
its length, no special tokens added.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tokens.hf import HfTokenizer
from gateway.tokens.local import HfCounter
from gateway.tokens.spec import make_counter

Messages = list[dict[str, Any]]
Prompt = str | list[int]

MIN_WORDS = 16
_WORD = re.compile(r" [A-Za-z]{2,}")
_ADJUST_ROUNDS = 6


class PromptError(ValueError):
    """A prompt of the asked length cannot be built; the message says why."""


@dataclass(frozen=True, slots=True)
class Built:
    """A request's prompt (`prompt` for completions, `messages` for chat) and its exact
    token count as the engine will report it in `usage.prompt_tokens`."""

    prompt_tokens: int
    prompt: Prompt | None = None
    messages: Messages | None = None


class PromptBuilder:
    def __init__(self, tokenizer: HfTokenizer, *, name: str = "hf") -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.words = _word_tokens(tokenizer)
        if len(self.words) < MIN_WORDS:
            raise PromptError(
                f"tokenizer {name}: found {len(self.words)} single-token words, need "
                f"{MIN_WORDS} to build prompts of exact lengths"
            )
        self._texts = {i: tokenizer.decode([i]) for i in self.words}
        self._groups: dict[tuple[str, int, int], tuple[Any, int]] = {}
        self._blocks: dict[tuple[int, int], list[int]] = {}

    @classmethod
    def from_spec(cls, spec: str, model: str = "model") -> PromptBuilder:
        """From a gateway tokenizer spec; only `hf:<dir>` / `hf:@tiny` can build prompts."""
        try:
            counter = make_counter(spec, model=model)
        except ValueError as exc:
            raise PromptError(str(exc)) from None
        if not isinstance(counter, HfCounter):
            raise PromptError(
                f"--tokenizer {spec!r}: prompts are built with the engine's tokenizer.json; "
                "give hf:<dir> (the model's tokenizer directory) or hf:@tiny"
            )
        return cls(counter.tokenizer, name=spec)

    # -- pieces ---------------------------------------------------------------------------

    def word_ids(self, n: int, rng: random.Random) -> list[int]:
        return [rng.choice(self.words) for _ in range(max(0, n))]

    def text(self, ids: Sequence[int]) -> str:
        return "".join(self._texts[i] for i in ids)

    def block(self, hash_id: int, tokens: int) -> list[int]:
        """The words of one trace prefix block: equal hash ids, equal words."""
        key = (hash_id, tokens)
        if key not in self._blocks:
            self._blocks[key] = self.word_ids(tokens, random.Random(f"block-{hash_id}"))
        return self._blocks[key]

    def count_completion(self, prompt: Prompt) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return self.tokenizer.count(prompt, add_special_tokens=True)

    def count_chat(self, messages: Messages, *, add_generation_prompt: bool = True) -> int:
        return self.tokenizer.count_chat(messages, add_generation_prompt)

    # -- completions ----------------------------------------------------------------------

    def completion(
        self,
        tokens: int,
        rng: random.Random,
        *,
        prefix: tuple[int, int] | None = None,
        hash_ids: Sequence[int] = (),
        block_tokens: int = 512,
        before: str = "",
        token_ids: bool = False,
    ) -> Built:
        """A completions prompt of exactly `tokens` tokens (for a session's next turn:
        `before` is the conversation so far and `tokens` what this turn adds).

        `prefix` = (group, P): the first P tokens are the group's; `hash_ids`: a trace's
        prefix blocks of `block_tokens` tokens each.
        """
        head = self._head_ids(tokens, prefix, hash_ids, block_tokens)
        if token_ids:
            if before:
                raise PromptError("token-id prompts cannot carry a conversation")
            ids = head + self.word_ids(tokens - len(head), rng)
            return Built(len(ids), prompt=ids)
        base = self.count_completion(before) if before else 0
        target = base + tokens
        head_text = before + self.text(head)

        def count(n: int) -> int:
            return self.count_completion(head_text + self.text(tail[:n]))

        tail = self.word_ids(tokens + 8, rng)
        n = self._fit(target, count, start=tokens - len(head) - self._special_overhead(base))
        while n > len(tail):
            tail += self.word_ids(n - len(tail), rng)
        prompt = head_text + self.text(tail[:n])
        return Built(target, prompt=prompt)

    def _special_overhead(self, base: int) -> int:
        # Special tokens the tokenizer adds to a text prompt (BOS), counted once.
        return 0 if base else self.count_completion(self._texts[self.words[0]]) - 1

    def _head_ids(
        self,
        tokens: int,
        prefix: tuple[int, int] | None,
        hash_ids: Sequence[int],
        block_tokens: int,
    ) -> list[int]:
        if prefix is not None:
            group, size = prefix
            if size >= tokens:
                raise PromptError(f"a shared prefix of {size} tokens leaves no room in {tokens}")
            return self.block(-1 - group, size)
        head: list[int] = []
        for h in hash_ids:
            take = min(block_tokens, tokens - 1 - len(head))
            if take <= 0:
                break
            head += self.block(h, block_tokens)[:take]
        return head

    # -- chat -----------------------------------------------------------------------------

    def chat(
        self,
        tokens: int,
        rng: random.Random,
        *,
        prefix: tuple[int, int] | None = None,
        hash_ids: Sequence[int] = (),
        block_tokens: int = 512,
        history: Messages | None = None,
    ) -> Built:
        """Chat messages whose rendered prompt is exactly `tokens` tokens — or, after a
        `history` (a session's earlier turns, answers included), `tokens` more than it.

        `prefix` = (group, P): a system message whose rendered turn is exactly P tokens,
        the same for every request of the group (its turn ends in the template's end-of-turn
        tokens, so the user turn cannot merge into it).
        """
        messages: Messages = [dict(m) for m in history or []]
        if history:
            target = self.count_chat(messages, add_generation_prompt=False) + tokens
        else:
            target = tokens
            if prefix is not None:
                messages.append(self._system(*prefix))
        head = self.text(self._head_ids(tokens, None, hash_ids, block_tokens))
        tail = self.word_ids(tokens + 8, rng)

        def count(n: int) -> int:
            content = head + self.text(tail[:n])
            return self.count_chat([*messages, {"role": "user", "content": content}])

        n = self._fit(target, count, start=1)
        while n > len(tail):
            tail += self.word_ids(n - len(tail), rng)
        messages.append({"role": "user", "content": head + self.text(tail[:n])})
        return Built(target, messages=messages)

    def _system(self, group: int, size: int) -> dict[str, Any]:
        key = ("chat", group, size)
        if key not in self._groups:
            words = self.block(-1 - group, size)

            def count(n: int) -> int:
                turn = [{"role": "system", "content": self.text(words[:n])}]
                return self.count_chat(turn, add_generation_prompt=False)

            n = self._fit(size, count, start=1, what="shared prefix")
            self._groups[key] = ({"role": "system", "content": self.text(words[:n])}, n)
        message, _ = self._groups[key]
        return dict(message)

    # -- the adjustment loop --------------------------------------------------------------

    def _fit(
        self, target: int, count: Callable[[int], int], *, start: int, what: str = "prompt"
    ) -> int:
        """The word count n ≥ 1 whose prompt counts exactly `target` tokens. Word tokens add
        one token each, so one measurement finds n; a few more rounds absorb tokenizers
        whose joins are not perfectly additive."""
        n = max(1, start)
        for _ in range(_ADJUST_ROUNDS):
            got = count(n)
            if got == target:
                return n
            n += target - got
            if n < 1:
                floor = count(1) - 1
                raise PromptError(
                    f"a {what} of {target} tokens is shorter than the {floor} tokens the "
                    "template and the rest of the request take"
                )
        raise PromptError(f"could not build a {what} of exactly {target} tokens")


def _word_tokens(tokenizer: HfTokenizer) -> list[int]:
    """Ids of one-word tokens that encode to themselves, alone and repeated (sorted)."""
    found: list[int] = []
    for token_id in range(min(tokenizer.vocab_size, 50_000)):
        if token_id in tokenizer.special_token_ids:
            continue
        text = tokenizer.decode([token_id])
        if not _WORD.fullmatch(text):
            continue
        if tokenizer.encode(text * 3, add_special_tokens=False) == [token_id] * 3:
            found.append(token_id)
    return found
