"""The request id: the client's `x-request-id` when it is a usable one, else the gateway's.

Usable means 1 to `MAX_LENGTH` visible ASCII characters (0x21-0x7E): it is echoed in a
response header, written to the log and sent on to the engine, so it must survive all three
byte for byte. Anything else (non-ASCII, spaces, control characters, too long, empty) is
replaced by a fresh id, which the response carries instead.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import Scope

MAX_LENGTH = 128
_USABLE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LENGTH)


def request_id(scope: Scope) -> str:
    """The request's id (see the module docstring)."""
    for key, value in scope.get("headers", ()):
        if key == b"x-request-id":
            given = bytes(value)
            if _USABLE.fullmatch(given):
                return given.decode("ascii")
            break
    return new_request_id()


def new_request_id() -> str:
    return uuid.uuid4().hex
