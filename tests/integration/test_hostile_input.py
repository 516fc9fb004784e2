"""Hostile bodies through a real gateway: a 400 in the OpenAI shape, one log line at most (no
traceback), nothing reserved — whatever the token counter."""

import json
import logging

import httpx
import pytest

from tests.integration.conftest import FAST, gateway_over

DEEP = 1_000  # json.loads raised RecursionError at this depth: a 500 and a traceback
HOSTILE = [
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": '
        + b"[" * DEEP
        + b"]" * DEEP
        + b"}",
    ),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
    # A lone surrogate reached the tokenizer, which raised TypeError: a 500 and a traceback.
    (
        "/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
    ),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": "a\ud800b"}).encode()),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": ["\udfff"]}).encode()),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
            }
        ).encode(),
    ),
]


@pytest.mark.parametrize("counter", ["hf:@tiny", "engine", "estimate"])
async def test_nested_and_lone_surrogate_bodies_are_400_without_a_traceback(counter, caplog):
    caplog.set_level(logging.DEBUG, logger="gateway")
    models = [{"name": "tiny", "tokenizer": counter}]
    async with gateway_over([FAST], models=models) as gw, httpx.AsyncClient(timeout=10) as http:
        for path, raw in HOSTILE:
            caplog.clear()
            r = await http.post(gw.url + path, content=raw)
            assert r.status_code == 400, (raw[:80], r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
            # At most one line, besides the request's access line (shown at debug).
            lines = [rec for rec in caplog.records if rec.name != "gateway.access"]
            assert len(lines) <= 1, [rec.getMessage() for rec in lines]
        assert not any(await gw.reserved_blocks_settle())
        ok = await http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert ok.status_code == 200
