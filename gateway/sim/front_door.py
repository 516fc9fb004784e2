"""vLLM's front-door queue limits: ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``.

vLLM (0.30+, ``AsyncLLM.check_admission``) refuses a request before it reaches the engine when

* ``max_num_queued_reqs`` is set and the unfinished requests (waiting + running, each of the
  ``n`` sequences counting one) plus the new request's sequences would exceed it; or
* ``max_num_queued_tokens`` is set and the prompt tokens of the requests still in prefill (no
  output yet; whole prompts, cached tokens included) already reach it, whatever the size of
  the new request.

The request limit is checked first; a limit of 0 refuses everything. A refusal is HTTP 503 and
counts once in ``vllm:admission_rejections_total{reason}``. Both limits are off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RefusalReason = Literal["max_num_queued_reqs", "max_num_queued_tokens"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("max_num_queued_reqs", "max_num_queued_tokens")


@dataclass(frozen=True)
class QueueLimits:
    """The two limits; None means no limit (vLLM's default)."""

    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def counts_tokens(self) -> bool:
        """Whether ``refusal`` reads the prefill backlog (callers may skip computing it)."""
        return self.max_num_queued_tokens is not None

    def refusal(
        self, *, unfinished: int, sequences: int, prefill_backlog_tokens: int
    ) -> RefusalReason | None:
        """Why a request of ``sequences`` engine sequences is refused now, or None."""
        limit = self.max_num_queued_reqs
        if limit is not None and unfinished + sequences > limit:
            return "max_num_queued_reqs"
        limit = self.max_num_queued_tokens
        if limit is not None and prefill_backlog_tokens >= limit:
            return "max_num_queued_tokens"
        return None
