"""One record per request, as measured; the JSON report holds them all so that every
aggregate can be recomputed from it (`from_dict(to_dict(r)) == r`).

Times are seconds from the run's start. Latencies are measured from the first attempt's send,
so retries and their waits count, as a user of an SDK that retries sees them. As in vLLM's
benchmark client, `e2e_s` of a stream ends at its last token and `tpot_s` is
`(e2e − ttft) / (output tokens − 1)`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

OK = "ok"
REFUSED = "refused"  # still 429 when the retries ran out
ERROR = "error"  # any other answer than 200, or no answer
CANCELLED = "cancelled"  # in flight when the run stopped (Ctrl-C, duration over)
OUTCOMES = (OK, REFUSED, ERROR, CANCELLED)


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_s: float
    status: int  # 0: no HTTP answer (connection refused, reset, timeout)
    answered_s: float | None = None  # when the answer's head (or the failure) came
    code: str | None = None  # the error body's code, or the transport failure
    advised_s: float | None = None  # what a 429's Retry-After / retry-after-ms advised
    waited_s: float | None = None  # how long the client waited before the next attempt


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int
    tenant: str
    api: str
    stream: bool
    input_tokens: int  # built to this exact count with the tokenizer
    max_tokens: int
    outcome: str
    status: int
    sent_s: float
    done_s: float
    scheduled_s: float | None = None  # open loop: when the schedule wanted it sent
    reason: str | None = None
    prompt_tokens: int | None = None  # the engine's usage
    output_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: tuple[float, ...] = ()
    attempts: tuple[Attempt, ...] = ()
    session: int | None = None
    turn: int = 1
    prefix_group: int | None = None
    warmup: bool = False
    target: str | None = None  # `compare --order mixed`: which target it was sent to

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def lag_s(self) -> float | None:
        """How late the client sent it against its schedule."""
        return None if self.scheduled_s is None else self.sent_s - self.scheduled_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def from_dict(data: dict[str, Any]) -> RequestRecord:
    names = {f.name for f in fields(RequestRecord)}
    values = {k: v for k, v in data.items() if k in names}
    values["itl_s"] = tuple(values.get("itl_s", ()))
    values["attempts"] = tuple(Attempt(**a) for a in values.get("attempts", ()))
    return RequestRecord(**values)
