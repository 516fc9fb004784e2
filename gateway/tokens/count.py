"""What a counter answers: the number of prompt tokens, and their ids where it knows them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, eq=False)
class TokenCount:
    """A prompt's token count, and its token ids when the counter has them.

    ``count`` is what admission uses. ``ids()`` gives the prompt's token ids as the engine will
    hold them (for prefix-cache lookups), or None: ``hf:`` and ``engine`` give them for text
    prompts; ``tiktoken:`` and ``estimate`` never do (their ids are not the model's), and no
    counter does for a prompt with media, whose cache blocks vLLM keys by the media's hashes
    too. The ids are materialised on first call only, so a request that never reads them pays
    nothing for them.
    """

    count: int
    _ids: Sequence[int] | Callable[[], Sequence[int]] | None = field(default=None, repr=False)

    def ids(self) -> Sequence[int] | None:
        """The token ids (``len(ids) == count``), or None when the counter cannot give them."""
        ids = self._ids
        if callable(ids):
            ids = ids()
            object.__setattr__(self, "_ids", ids)  # computed once; still frozen to callers
        return ids

    @property
    def has_ids(self) -> bool:
        return self._ids is not None

    @classmethod
    def of_ids(cls, ids: Sequence[int]) -> TokenCount:
        """A count that is the length of known ids (token-id prompts, ``/tokenize``)."""
        return cls(len(ids), ids)

    def __eq__(self, other: object) -> bool:
        # Counts compare by their number; ids are a by-product.
        if isinstance(other, TokenCount):
            return self.count == other.count
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.count)
