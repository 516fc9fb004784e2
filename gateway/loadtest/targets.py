"""What a run is sent to: a target's base URLs, what it is (a gateway or an engine), and
where its metrics are — found by asking it.

`--target [NAME=]URL[,URL...]`: several URLs are engines the client spreads its requests over
itself (round robin). A target that answers `GET /admin/status` with an `engines` list is a
kv-gateway: its own `/metrics` is scraped, and so are the engines the status names (unless
given with `--engine-metrics`). Anything else is taken as an engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


class TargetError(RuntimeError):
    """A target cannot be used; the message is one line."""


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    urls: tuple[str, ...]
    kind: str = "engine"  # "gateway" | "engine"
    engine_metrics: tuple[str, ...] = ()
    gateway_metrics: str | None = None
    model: str | None = None
    max_model_len: int | None = None


def parse_target(text: str, default_name: str = "target") -> tuple[str, tuple[str, ...]]:
    """`name=url,url` or `url,url` → (name, urls); TargetError when a URL is not http(s)."""
    name, sep, rest = text.partition("=")
    if not sep or name.startswith(("http://", "https://")):
        name, rest = default_name, text
    urls = tuple(u.strip().rstrip("/") for u in rest.split(",") if u.strip())
    if not urls:
        raise TargetError(f"target {text!r}: no URL")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise TargetError(f"target {text!r}: {url!r} is not an http(s) URL")
    return name.strip() or default_name, urls


async def resolve(
    name: str,
    urls: tuple[str, ...],
    *,
    model: str | None = None,
    admin_key: str | None = None,
    api_key: str | None = None,
    engine_metrics: tuple[str, ...] = (),
    timeout_s: float = 10.0,
) -> Target:
    """Ask each URL for its models (the model to use, max_model_len) and whether it is a
    gateway. Raises TargetError (one line) when a URL does not answer as an OpenAI server."""
    found_model, max_len = model, None
    kind, engines, gateway_metrics = "engine", list(engine_metrics), None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    admin = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        for url in urls:
            models = await _models(http, url, headers)
            ids = [m.get("id") for m in models if isinstance(m, dict)]
            if found_model is None:
                if not ids:
                    raise TargetError(f"target {name}: {url}/v1/models lists no model")
                found_model = str(ids[0])
            elif found_model not in ids:
                raise TargetError(
                    f"target {name}: {url} does not serve model {found_model!r} (it serves "
                    f"{', '.join(map(str, ids)) or 'nothing'})"
                )
            for m in models:
                if isinstance(m, dict) and m.get("id") == found_model and m.get("max_model_len"):
                    len_here = int(m["max_model_len"])
                    max_len = len_here if max_len is None else min(max_len, len_here)
            status = await _status(http, url, admin)
            if status is not None:
                kind, gateway_metrics = "gateway", url
                if not engine_metrics:
                    engines += [str(e["url"]) for e in status["engines"] if e.get("url")]
            elif not engine_metrics:
                engines.append(url)
    return Target(
        name,
        urls,
        kind,
        tuple(dict.fromkeys(u.rstrip("/") for u in engines)),
        gateway_metrics,
        found_model,
        max_len,
    )


async def _models(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> list[Any]:
    try:
        response = await http.get(url + "/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise TargetError(f"cannot reach {url}: {type(exc).__name__} {exc}".strip()) from None
    if response.status_code != 200:
        raise TargetError(f"{url}/v1/models answered {response.status_code}: {_brief(response)}")
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        data = None
    if not isinstance(data, list):
        raise TargetError(f"{url}/v1/models is not an OpenAI model list")
    return data


async def _status(
    http: httpx.AsyncClient, url: str, headers: dict[str, str]
) -> dict[str, Any] | None:
    try:
        response = await http.get(url + "/admin/status", headers=headers)
        body = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if isinstance(body, dict) and isinstance(body.get("engines"), list):
        return body
    return None


def _brief(response: httpx.Response) -> str:
    return " ".join(response.text.split())[:160] or "(empty body)"


def read_secret(env: str | None, file: str | None, what: str) -> str | None:
    """A key from an environment variable or a file (never from argv); TargetError if the
    named variable is unset or the file unreadable."""
    if env and file:
        raise TargetError(f"give the {what} by environment variable or by file, not both")
    if env:
        value = os.environ.get(env)
        if not value:
            raise TargetError(f"{what}: environment variable {env} is not set")
        return value.strip()
    if file:
        try:
            return Path(file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TargetError(f"{what}: cannot read {file}: {exc.strerror}") from None
    return None
