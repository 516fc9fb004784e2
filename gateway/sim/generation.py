"""Deterministic "model output": which token ids a request generates, and their text.

The simulator has no model; it picks plausible token ids from the tokenizer's vocabulary with a
PRNG seeded by the request (its ``seed``, else the server's ``--seed``, plus the prompt's token
ids and the choice index), so the same request always gets the same text. Special tokens are
never generated, except EOS as the last token of an EOS-bounded output.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.tokens.hf import HfTokenizer

# Length of an EOS-bounded output is drawn uniformly from 1..this (the EOS token included).
NATURAL_LENGTH_MAX = 96


@dataclass(frozen=True)
class OutputPlan:
    """All tokens one sequence will generate; ``finish_reason`` is how it ends."""

    token_ids: tuple[int, ...]
    finish_reason: Literal["stop", "length"]

    def __len__(self) -> int:
        return len(self.token_ids)


class OutputPlanner:
    """Plans outputs and turns generated token ids into text, for one tokenizer."""

    def __init__(self, tokenizer: HfTokenizer, seed: int) -> None:
        self._seed = seed
        self._eos = tokenizer.eos_token_id
        self._pieces: dict[int, str] = {}
        # Only ids that decode to whole characters on their own: then the text of a sequence
        # is the concatenation of its pieces, and streaming deltas are exact.
        for token_id in range(tokenizer.vocab_size):
            if token_id in tokenizer.special_token_ids:
                continue
            piece = tokenizer.decode([token_id])
            if piece and "\ufffd" not in piece:
                self._pieces[token_id] = piece
        self._choices = sorted(self._pieces)
        if not self._choices:
            raise ValueError("the tokenizer has no plain-text tokens to generate")

    def plan(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool,
        seed: int | None,
        index: int,
    ) -> OutputPlan:
        """``max_tokens`` tokens with ``ignore_eos`` (or without an EOS token); otherwise a
        seeded length in 1..NATURAL_LENGTH_MAX ending in EOS, cut at ``max_tokens``."""
        rng = random.Random(self._seed_material(prompt_ids, seed, index))
        length = max_tokens
        stops = False
        if not ignore_eos and self._eos is not None:
            natural = rng.randint(1, NATURAL_LENGTH_MAX)
            if natural <= max_tokens:
                length, stops = natural, True
        content = [rng.choice(self._choices) for _ in range(length - 1 if stops else length)]
        if stops:
            assert self._eos is not None
            content.append(self._eos)
        return OutputPlan(tuple(content), "stop" if stops else "length")

    def piece(self, token_id: int) -> str:
        """Text of one generated token; EOS renders as nothing (vLLM skips special tokens)."""
        return self._pieces.get(token_id, "")

    def text(self, token_ids: Sequence[int]) -> str:
        return "".join(self.piece(t) for t in token_ids)

    def _seed_material(self, prompt_ids: Sequence[int], seed: int | None, index: int) -> int:
        digest = hashlib.sha256()
        digest.update(repr((self._seed if seed is None else seed, index)).encode())
        digest.update(b",".join(str(t).encode() for t in prompt_ids))
        return int.from_bytes(digest.digest()[:8], "big")
