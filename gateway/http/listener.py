"""The client-facing HTTP/1.1 listener: uvicorn's httptools protocol with limits on slow
clients, on request heads and on open connections.

uvicorn bounds neither how long a client may take to send its request headers nor its body
(a connection that sends one header byte every few seconds stays open forever), nor how large
the headers are (one 64 MiB header was parsed whole), nor how many connections are open. An
ASGI middleware cannot add that: the app is called only once the headers are complete. So the
protocol itself is subclassed (measured in docs/operations.md, "What a slowloris costs" and
"What a large header costs"):

- **Headers** must be complete within `header_timeout_s` of the connection opening, or of the
  previous answer's end on a kept-alive connection. Late: 408 if part of a request arrived,
  else the connection is just closed (an idle keep-alive one too).
- **Body**: complete within `body_timeout_s` of the headers, or 408 (and the connection
  closed): the request was never admitted, so nothing is reserved.
- **Head size**: a request's head (request line and headers) is fed to the parser only up
  to `max_head_bytes`; the byte past it is never parsed and the request is answered 431
  `request_header_fields_too_large`. So a connection holds at most that much of a head,
  however much is sent. Within it, one header over `max_header_bytes` or more than
  `max_headers` headers is a 431 too, and a request target over `max_url_bytes` a 414
  `uri_too_long`. These answers end the connection (see `LINGER_S`). (A pipelined
  request's head that begins in the same read as the previous request ends is counted from
  the next read: such a head may reach `max_head_bytes` plus one read, at most 256 KiB.)
- **Connections**: at most `max_connections` open at once, and at most
  `max_connections_per_address` from one client address (off by default: behind a load
  balancer every client has its address). A connection over a cap gets 503
  `too_many_connections` and is closed at once, before anything is read.

A request whose headers and body arrived is never cut by these timers, however long its
answer streams. Contract with uvicorn: the hooks used (`connection_made`, `connection_lost`,
`data_received`, `on_message_begin`, `on_url`, `on_header`, `on_headers_complete`,
`on_message_complete`, `on_response_complete`, `send_400_response`, `cycle`, `url`,
`headers`) are those of `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` since
0.30, and a parser callback's exception reaches `send_400_response` (as httptools' callback
error); tests/integration/test_slow_clients.py and test_large_heads.py fail if they change.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import ClientsConfig
from gateway.errors import GatewayError
from gateway.http.errors import raw_response
from gateway.http.request_ids import new_request_id
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class TooManyConnections(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "too_many_connections"


class HeadTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"


class UrlTooLong(GatewayError):
    status = 414
    type = "invalid_request_error"
    code = "uri_too_long"


REFUSALS_LOGGED_EVERY_S = 10.0
"""A flood of connections over a cap writes one log line per this many seconds, not one per
connection."""

LINGER_S = 1.0
LINGER_BYTES = 1024 * 1024
"""After a 431 or 414 the connection is closed once the client stops sending, or after this
long or this many more bytes (read and dropped) at most: closed while the client's bytes are
still unread, it would be reset, and the client could lose the answer (nginx's
lingering_close)."""


@dataclass
class ConnectionLedger:
    """Open connections, in all and per client address (one per listener, shared by its
    connections: one event loop, no lock needed), and what the listener cut off."""

    max_connections: int
    max_per_address: int | None = None
    metrics: GatewayMetrics | None = None
    total: int = 0

    def __post_init__(self) -> None:
        self.by_address: Counter[str] = Counter()
        self._refused = 0  # since the last log line
        self._refusal_logged_at = float("-inf")

    def enter(self, address: str) -> str | None:
        """Count a new connection; the reason it is over a cap, or None."""
        self.total += 1
        self.by_address[address] += 1
        self._gauge()
        if self.total > self.max_connections:
            return f"more than {self.max_connections} connections are open"
        if self.max_per_address is not None and self.by_address[address] > self.max_per_address:
            return f"more than {self.max_per_address} connections are open from {address}"
        return None

    def leave(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]
        self._gauge()

    def cut_off(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.client_cutoffs.labels(reason).inc()

    def refused(self, why: str, now: float) -> None:
        self.cut_off("too_many_connections")
        self._refused += 1
        if now - self._refusal_logged_at >= REFUSALS_LOGGED_EVERY_S:
            log.warning("refused %d connection(s): %s", self._refused, why)
            self._refused, self._refusal_logged_at = 0, now

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.client_connections.set(self.total)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One client connection (see the module docstring). Made per listener by
    `protocol_for`, which sets the class attributes."""

    limits: ClientsConfig
    ledger: ConnectionLedger

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address: str | None = None  # counted in the ledger under this
        self._request_begun = False
        self._timer: asyncio.TimerHandle | None = None
        self._timing = ""  # what `_timer` times: "headers", "body" or "linger"
        # Bytes the current request's head may still take; None once its headers are in.
        self._head_room: int | None = self.limits.max_head_bytes
        self._refusal: GatewayError | None = None  # raised by a parser callback
        self._linger_left: int | None = None  # bytes still dropped after a refusal

    # -- connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else ""
        self._address = address
        refused = self.ledger.enter(address)
        if refused is not None:
            self.ledger.refused(refused, self.loop.time())
            error = TooManyConnections(
                "Too many connections are open; retry shortly.", headers={"retry-after": "1"}
            )
            self._answer_and_close(error)
            return
        self._arm("headers", self.limits.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._address is not None:
            self.ledger.leave(self._address)
            self._address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but a head is parsed only up to `max_head_bytes`: past it, 431."""
        room = self._head_room
        if room is not None:
            if len(data) > room:
                self._feed_past_room(memoryview(data), room)
                return
            # Before feeding: the parser's callbacks reset it when the head ends.
            self._head_room = room - len(data)
        super().data_received(data)

    def _feed_past_room(self, data: memoryview, room: int) -> None:
        """Feed `data` of which only `room` bytes may still belong to the current head: that
        much first; if the head did not end in it, refuse without parsing the rest."""
        if self._linger_left is not None:  # refused: room stays 0, so every byte comes here
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.close()
            return
        while True:
            self._head_room = 0
            super().data_received(data[:room])  # type: ignore[arg-type]  # httptools takes it
            if self.transport.is_closing() or self._linger_left is not None:  # answered
                return
            if self._head_room == 0:
                limit = self.limits.max_head_bytes
                self._refuse(HeadTooLarge(f"The request headers are longer than {limit} bytes."))
                return
            data = data[room:]
            next_room = self._head_room
            if next_room is None or len(data) <= next_room:
                if next_room is not None:
                    self._head_room = next_room - len(data)
                super().data_received(data)  # type: ignore[arg-type]
                return
            room = next_room

    def send_400_response(self, msg: str) -> None:
        # A parser callback's refusal arrives here as httptools' callback error.
        refusal, self._refusal = self._refusal, None
        if refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(refusal)

    def _refuse(self, error: GatewayError) -> None:
        self.ledger.cut_off(error.code or "")
        log.info("client %s: %s: %d", self._who(), error.message, error.status)
        self._head_room = 0
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request on this connection is being answered: an answer now would
            # land inside that one.
            self.transport.close()
        elif not self.transport.can_write_eof():
            self._answer_and_close(error)
        else:  # see LINGER_S
            self.transport.write(raw_response(error, new_request_id()))
            self.transport.write_eof()
            self._linger_left = LINGER_BYTES
            self._arm("linger", LINGER_S, self.transport.close)

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._request_begun = True
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            limit = self.limits.max_url_bytes
            self._refusal = UrlTooLong(f"The request target is longer than {limit} bytes.")
            raise self._refusal

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.limits.max_header_bytes:
            limit = self.limits.max_header_bytes
            self._refusal = HeadTooLarge(f"A request header is longer than {limit} bytes.")
            raise self._refusal
        if len(self.headers) >= self.limits.max_headers:
            limit = self.limits.max_headers
            self._refusal = HeadTooLarge(f"The request has more than {limit} headers.")
            raise self._refusal
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_room = None
        self._arm("body", self.limits.body_timeout_s, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        # The next request's head is counted from here.
        self._head_room = self.limits.max_head_bytes
        # Only the body's timer: an answer may have ended before the body did (a 413), and
        # then the next request's headers are already being timed.
        self._disarm("body")
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Kept alive and idle: the next request's headers are timed from now. (A pipelined
        # request already read is running: its headers are in.)
        if not self.transport.is_closing() and not self.pipeline:
            self._request_begun = False
            self._arm("headers", self.limits.header_timeout_s, self._headers_late)

    # -- timers ------------------------------------------------------------------------------

    def _arm(self, timing: str, delay: float, callback: Any) -> None:
        self._disarm()
        self._timer, self._timing = self.loop.call_later(delay, callback), timing

    def _disarm(self, timing: str | None = None) -> None:
        """Cancel the timer (only if it times `timing`, when given)."""
        if self._timer is not None and timing in (None, self._timing):
            self._timer.cancel()
            self._timer = None

    def _headers_late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if not self._request_begun:  # nothing sent: an idle connection, closed quietly
            self.transport.close()
            return
        limit = self.limits.header_timeout_s
        self.ledger.cut_off("header_timeout")
        log.info("client %s: request headers not complete within %g s: 408", self._who(), limit)
        self._answer_and_close(RequestTimeout(f"The request headers took longer than {limit:g} s."))

    def _body_late(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        limit = self.limits.body_timeout_s
        self.ledger.cut_off("body_timeout")
        log.info("client %s: request body not complete within %g s: 408", self._who(), limit)
        started = cycle.response_started
        # The app (reading the body) sees a disconnect and sends nothing more.
        cycle.disconnected = True
        cycle.message_event.set()
        if started:
            self.transport.close()
        else:
            self._answer_and_close(
                RequestTimeout(f"The request body took longer than {limit:g} s.")
            )

    def _answer_and_close(self, error: GatewayError) -> None:
        self.transport.write(raw_response(error, new_request_id()))
        self.transport.close()

    def _who(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"


def protocol_for(
    limits: ClientsConfig, metrics: GatewayMetrics | None = None
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class of one listener: its limits and its own connection ledger (which
    keeps `metrics`' client gauges, when given)."""
    ledger = ConnectionLedger(limits.max_connections, limits.max_connections_per_address, metrics)
    return type(
        "GatewayHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {"limits": limits, "ledger": ledger},
    )
