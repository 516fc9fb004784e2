"""What each request of a run is: tenants, their lengths, shapes and load, or a trace.

A `TenantLoad` is one API client of the run: its key, its load (an open-loop arrival
schedule or a closed-loop concurrency), its request shape (chat or completions, streaming,
input and output length distributions, shared-prefix groups, multi-turn sessions). A
`RequestSpec` is one request (or one session's first turn) drawn from it; drawing is pure:
the `random.Random` is passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gateway.loadtest.arrivals import Arrivals
from gateway.loadtest.lengths import Lengths
from gateway.traces import MOONCAKE_BLOCK_TOKENS, Trace

APIS = ("chat", "completions")


@dataclass(frozen=True, slots=True)
class Shape:
    """How a tenant's requests look."""

    api: str = "chat"
    stream: bool = True
    input_len: Lengths = field(default_factory=lambda: Lengths("fixed", 128))
    output_len: Lengths = field(default_factory=lambda: Lengths("fixed", 64))
    ignore_eos: bool = True
    token_ids: bool = False
    prefix_groups: int = 0
    prefix_tokens: int = 0
    turns: int = 1
    think_time_s: float = 0.0
    # What each later turn of a session adds (None: drawn from `input_len` too), so that a
    # first turn can carry a long system prompt while later turns stay chat-sized.
    turn_input_len: Lengths | None = None

    def validate(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, not {self.api!r}")
        if self.token_ids and self.api != "completions":
            raise ValueError("--token-ids needs --api completions")
        if self.prefix_groups < 0 or self.prefix_tokens < 0:
            raise ValueError("--prefix-groups and --prefix-tokens must not be negative")
        if bool(self.prefix_groups) != bool(self.prefix_tokens):
            raise ValueError("give both --prefix-groups and --prefix-tokens (or neither)")
        if self.turns < 1:
            raise ValueError("--turns must be at least 1")
        if self.turns > 1 and self.token_ids:
            raise ValueError("multi-turn sessions re-send text: drop --token-ids")
        if self.turn_input_len is not None and self.turns == 1:
            raise ValueError("--turn-input-len is what later turns add: give --turns too")
        if self.think_time_s < 0:
            raise ValueError("--think-time must not be negative")


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One client of the run. Exactly one of `arrivals` (open loop) and `concurrency`
    (closed loop) is set; `max_concurrency` caps an open loop's requests in flight."""

    name: str
    shape: Shape = field(default_factory=Shape)
    arrivals: Arrivals | None = None
    concurrency: int | None = None
    max_concurrency: int | None = None
    api_key: str | None = None

    def validate(self) -> None:
        self.shape.validate()
        if (self.arrivals is None) == (self.concurrency is None):
            raise ValueError(f"tenant {self.name}: give either a rate or a concurrency")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"tenant {self.name}: concurrency must be at least 1")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"tenant {self.name}: --max-concurrency must be at least 1")

    def describe(self) -> str:
        load = (
            f"closed loop, {self.concurrency} concurrent"
            if self.arrivals is None
            else self.arrivals.describe()
        )
        s = self.shape
        parts = [load, s.api + (" stream" if s.stream else ""), f"in {s.input_len}"]
        parts.append(f"out {s.output_len}")
        if s.prefix_groups:
            parts.append(f"{s.prefix_groups} prefix groups of {s.prefix_tokens}")
        if s.turns > 1:
            added = f", each later turn +{s.turn_input_len}" if s.turn_input_len else ""
            parts.append(f"{s.turns}-turn sessions{added}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to build and send (a session's turns share `session`)."""

    tenant: str
    input_tokens: int
    output_tokens: int
    prefix: tuple[int, int] | None = None
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    turns: int = 1


def next_turn_input(shape: Shape, rng: random.Random) -> int:
    """The tokens a session's next turn adds to the conversation."""
    return (shape.turn_input_len or shape.input_len).sample(rng)


def draw(tenant: TenantLoad, rng: random.Random, max_len: int | None = None) -> RequestSpec:
    """The next request of a synthetic tenant (a session's first turn when turns > 1)."""
    s = tenant.shape
    output = s.output_len.sample(rng)
    room = None if max_len is None else max(1, max_len - output)
    prefix = None
    if s.prefix_groups:
        prefix = (rng.randrange(s.prefix_groups), s.prefix_tokens)
    inp = s.input_len.sample(rng, room)
    if prefix is not None:
        inp = max(inp, s.prefix_tokens + 1)
    return RequestSpec(tenant.name, inp, output, prefix, turns=s.turns)


def from_trace(trace: Trace, default_tenant: str, block_tokens: int) -> list[RequestSpec]:
    """Every request of a trace, in order; a request's tenant is the trace's or the default."""
    return [
        RequestSpec(
            r.tenant or default_tenant,
            max(1, r.input_tokens),
            max(1, r.output_tokens),
            hash_ids=r.hash_ids,
            block_tokens=block_tokens,
        )
        for r in trace.requests
    ]
