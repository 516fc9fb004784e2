"""`--log-format`: `text` (the default: one human line per record) or `json` (one JSON object
per line, for log pipelines). In `json` the access log (`gateway.access`, one line per
request as it ends: request id, tenant, model, engine, blocks, outcome, tokens and timings)
is on at `info`; in `text` it is shown at `--log-level debug` only, as the engine probes'
lines are (a line per request is noise on a console, and costs CPU on the hot path)."""

from __future__ import annotations

import json
import logging
import time
from typing import Literal

LogFormat = Literal["text", "json"]
ACCESS_LOGGER = "gateway.access"


class JsonLines(logging.Formatter):
    """`{"ts", "level", "logger", "message", "worker"?, ...}`; an access record's fields at the
    top level, an exception's traceback under `exception`."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "ts": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
