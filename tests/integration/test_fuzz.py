"""Fuzzing a real gateway (`kv-gateway serve`, loopback) in front of a simulated engine.

Hypothesis builds chat and completions bodies from the request schemas — every field the
gateway reads, with values of the right and of every wrong type, unknown fields with any JSON,
lone surrogates, deep nesting, broken bytes — and a corpus adds the known-bad bodies. The
gateway must never answer 5xx, must answer every refusal in the OpenAI shape, must log no
traceback, and must hold nothing once the traffic is over.

CI runs `FUZZ_EXAMPLES` generated requests (≥ 1,000, well under a minute); set
`KVGW_FUZZ_EXAMPLES` for a longer run. Generation is derandomized so CI sees the same bodies
each time; `KVGW_FUZZ_SEED` (an integer) explores others.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from gateway.harness import GatewayProcess, SimProcess
from tests.media.images import data_url, image_bytes

FUZZ_EXAMPLES = int(os.environ.get("KVGW_FUZZ_EXAMPLES", "1100"))
FUZZ_SEED = os.environ.get("KVGW_FUZZ_SEED")
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    "score": "/score",
    "rerank": "/rerank",
    "responses": "/v1/responses",
}

# ---- strategies over the request schemas ----------------------------------------------------

lone_surrogate = st.integers(0xD800, 0xDFFF).map(chr)
# Any text, lone surrogates included now and then (json.dumps escapes them as \udXXX).
text = st.one_of(
    st.text(max_size=40),
    st.lists(st.one_of(st.text(max_size=8), lone_surrogate), max_size=4).map("".join),
)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
any_json = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)
clean_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
token_ids = st.lists(st.integers(0, 500), min_size=1, max_size=12)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": clean_text})
PNG = data_url(image_bytes(64, 48))
image_url = st.one_of(
    clean_text,
    st.just(PNG),
    st.just("http://images.invalid/a.png"),  # counted at the worst case: never fetched
    st.builds(lambda s: "data:image/png;base64," + s, clean_text),  # broken base64
    st.just(data_url(b"GIF89a truncated")),
)
image_part = st.fixed_dictionaries(
    {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_url})}
)
other_part = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("video_url"), "video_url": st.fixed_dictionaries({"url": clean_text})}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["hologram", "image_embeds", "thinking"])}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": clean_text}),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
        "content": st.one_of(
            clean_text,
            st.none(),
            st.lists(st.one_of(text_part, text_part, image_part, other_part), max_size=3),
        ),
    },
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": clean_text,
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {
                            "name": clean_text,
                            "arguments": st.one_of(clean_text, st.just('{"a": 1}')),
                        }
                    ),
                }
            ),
            max_size=2,
        ),
        "name": clean_text,
    },
)
json_schema = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean"])}),
    lambda inner: st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(clean_text, inner, max_size=3)},
        optional={"required": st.lists(clean_text, max_size=2)},
    ),
    max_leaves=6,
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": clean_text},
            optional={
                "description": st.one_of(st.none(), clean_text),
                "parameters": st.one_of(st.none(), json_schema),
                "strict": st.one_of(st.none(), st.booleans()),
            },
        ),
    },
    optional={"defer_loading": st.booleans()},
)
# The fields every body may carry, with valid values: the gateway reads the first five; the
# others are a few of OpenAI's and vLLM's extensions, passed through.
optional = {
    "max_tokens": st.integers(1, 24),
    "max_completion_tokens": st.integers(1, 24),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "seed": st.integers(0, 2**31),
    "ignore_eos": st.booleans(),
    "stop": st.lists(clean_text, max_size=2),
}
chat_optional = {
    **optional,
    "tools": st.lists(tool, min_size=1, max_size=3),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "chat_template_kwargs": st.fixed_dictionaries(
        {}, optional={"enable_thinking": st.booleans(), "documents": st.just([{"text": "d"}])}
    ),
    "documents": st.lists(
        st.fixed_dictionaries({"title": clean_text, "text": clean_text}), max_size=2
    ),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "reasoning_effort": st.sampled_from(["none", "low", "high"]),
    "mm_processor_kwargs": st.fixed_dictionaries(
        {}, optional={"min_pixels": st.integers(1, 10**6), "max_pixels": st.integers(1, 10**7)}
    ),
}
inputs = st.one_of(
    clean_text,
    st.lists(clean_text, min_size=1, max_size=3),
    token_ids,
    st.lists(token_ids, min_size=1, max_size=3),
)
valid = {
    "chat": st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=3)},
        optional=chat_optional,
    ),
    "embeddings": st.one_of(
        st.fixed_dictionaries({"model": st.just("tiny"), "input": inputs}),
        st.fixed_dictionaries(
            {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=2)}
        ),
    ),
    "tokenize": st.one_of(
        st.fixed_dictionaries({"model": st.just("tiny"), "prompt": clean_text}),
        st.fixed_dictionaries(
            {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=2)},
            optional={"tools": st.lists(tool, min_size=1, max_size=2)},
        ),
    ),
    "detokenize": st.fixed_dictionaries({"model": st.just("tiny"), "tokens": token_ids}),
    "score": st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "queries": st.one_of(clean_text, st.lists(clean_text, min_size=1, max_size=2)),
            "documents": st.lists(clean_text, min_size=1, max_size=3),
        }
    ),
    "rerank": st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "query": clean_text,
            "documents": st.lists(clean_text, min_size=1, max_size=3),
        }
    ),
    "responses": st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "input": st.one_of(
                clean_text,
                st.lists(
                    st.fixed_dictionaries(
                        {"role": st.sampled_from(["user", "system"]), "content": clean_text}
                    ),
                    min_size=1,
                    max_size=2,
                ),
            ),
        },
        optional={
            "instructions": clean_text,
            "max_output_tokens": st.integers(1, 24),
            "previous_response_id": clean_text,
            "tools": st.lists(
                st.fixed_dictionaries({"type": st.just("function"), "name": clean_text}),
                max_size=2,
            ),
        },
    ),
    "completion": st.fixed_dictionaries(
        {
            "model": st.just("tiny"),
            "prompt": st.one_of(
                clean_text,
                st.lists(clean_text, min_size=1, max_size=3),
                token_ids,
                st.lists(token_ids, min_size=1, max_size=3),
            ),
        },
        optional=optional,
    ),
}
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "tokens",
    "queries",
    "documents",
    "query",
    *chat_optional,
]


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A path and raw body bytes: a body valid by the schema, then (most of the time) made
    hostile — fields replaced by any JSON or removed, unknown fields added, nested deep,
    wrapped, cut short or corrupted."""
    kind = draw(st.sampled_from([*(["chat", "completion"] * 3), *list(PATHS)[2:]]))
    body: dict[str, Any] = draw(valid[kind])
    if body.get("stream_options") and not body.get("stream"):
        del body["stream_options"]  # valid means valid: vLLM refuses the pair
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        field = draw(st.one_of(st.sampled_from(FIELDS), text))
        if draw(st.integers(0, 4)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(any_json)
    raw = json.dumps(body).encode()
    mutation = draw(st.sampled_from(["none"] * 8 + ["deep", "truncate", "bytes", "top"]))
    if mutation == "deep":
        depth = draw(st.integers(2, 3_000))
        raw = raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    elif mutation == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif mutation == "bytes":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    elif mutation == "top":
        raw = json.dumps(draw(any_json)).encode()
    return PATHS[kind], raw


# ---- the corpus of known-bad bodies ---------------------------------------------------------


def corpus() -> Iterator[tuple[str, bytes]]:
    chat, completion = PATHS["chat"], PATHS["completion"]
    msgs = b'"messages": [{"role": "user", "content": "x"}]'
    for depth in (65, 999, 1_000, 1_001, 5_000, 100_000):
        yield chat, b'{"model": "tiny", ' + msgs + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
        yield completion, b'{"model": "tiny", "prompt": ' + b"{" * depth + b"}" * depth + b"}"
    yield completion, b"[" * 50_000
    for s in ("\ud800", "\udfff", "a\ud800b", "\udc00\ud800"):
        yield chat, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": s}]})
        yield completion, json.dumps({"model": "tiny", "prompt": s}).encode()
        yield completion, json.dumps({"model": "tiny", "prompt": ["ok", s]}).encode()
        yield completion, json.dumps({"model": s, "prompt": "x"}).encode()
        yield completion, json.dumps({"model": "tiny", "prompt": "x", s: s}).encode()
    yield completion, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}'  # an encoded surrogate
    yield completion, b'{"model": "tiny", "prompt": "\xff\xfe"}'
    yield completion, '{"model": "tiny", "prompt": "x"}'.encode("utf-16")
    yield completion, b'\xef\xbb\xbf{"model": "tiny", "prompt": "x"}'
    yield completion, b'{"model": "tiny", "prompt": "x", "temperature": NaN}'
    yield completion, b'{"model": "tiny", "prompt": "x", "max_tokens": Infinity}'
    yield completion, b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 5_000 + b"}"
    yield completion, b'{"model": "tiny", "prompt": "x", "max_tokens": 1e999}'
    yield completion, b'{"model": "tiny", "prompt": "x", "n": 99999999999999999999999}'
    yield completion, b'{"model": "tiny", "prompt": [' + b"1," * 100_000 + b"1]}"
    yield completion, b'{"model": "tiny", "prompt": "x", "model": 5}'
    yield chat, b'{"model": "tiny", "messages": [{"role": "user", "content": [null, 1]}]}'
    yield chat, b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": 1}]}]}'
    msg = [{"role": "user", "content": "x"}]
    for extra in (
        {"tools": []},
        {"tools": [{"type": "function", "function": {}}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        {"tools": "all of them"},
        {"chat_template": "{% for %}"},
        {"chat_template_kwargs": {"tools": 5}},
        {"chat_template_kwargs": {"chat_template": "{{ x }}"}},
        {"documents": "not a list"},
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": True},
        {"add_generation_prompt": "yes"},
        {"reasoning_effort": "extreme"},
        {"mm_processor_kwargs": [1]},
    ):
        yield chat, json.dumps({"model": "tiny", "messages": msg, **extra}).encode()
    for url in (
        "data:image/png;base64,####",
        "data:image/png;base64,",
        "data:,",
        "file:///etc/passwd",
    ):
        part = {"type": "image_url", "image_url": {"url": url}}
        body = {"model": "tiny", "messages": [{"role": "user", "content": [part]}]}
        yield chat, json.dumps(body).encode()
    huge = data_url(image_bytes(3000, 2))  # beyond Qwen's aspect-ratio limit
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": huge}}]}
        ],
    }
    yield chat, json.dumps(body).encode()
    yield PATHS["score"], b'{"model": "tiny", "queries": ["a", "b"], "documents": ["c", "d", "e"]}'
    yield PATHS["rerank"], b'{"model": "tiny", "query": {"image": 1}, "documents": []}'
    yield PATHS["embeddings"], b'{"model": "tiny", "input": []}'
    yield PATHS["tokenize"], b'{"prompt": "no model"}'
    yield PATHS["responses"], b'{"model": "tiny", "input": [{"type": "message", "role": 5}]}'
    yield chat, b""
    yield chat, b"null"
    yield chat, b"\x00" * 64


RAW_REQUESTS = [
    # Framing the HTTP parser refuses (uvicorn's 400) or that ends early.
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b'POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{"model"',
]


# ---- the test ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    workdir = tmp_path_factory.mktemp("fuzz")
    engine = SimProcess(
        workdir=workdir,
        num_gpu_blocks=257,
        block_size=16,
        max_model_len=128,
        max_num_seqs=32,
        prefill_ms_per_token=0.0,
        decode_ms_base=0.2,
        decode_ms_per_seq=0.0,
    ).start()
    config = {
        "engines": [{"name": "e0", "url": engine.url, "max_num_seqs": 32}],
        "models": [
            {
                "name": "tiny",
                "tokenizer": "hf:@tiny",
                "media": {"family": "qwen2_vl", "max_pixels": 64 * 784, "worst_case": {"video": 8}},
            }
        ],
        "queue": {"max_wait_s": 5},
    }
    gateway = GatewayProcess(config, workdir, log_level="info")
    try:
        gateway.start()
        yield gateway
    finally:
        gateway.stop()
        engine.stop()


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.by_status: dict[int, int] = {}

    def check(self, path: str, raw: bytes, response: httpx.Response) -> None:
        self.sent += 1
        self.by_status[response.status_code] = self.by_status.get(response.status_code, 0) + 1
        where = (path, raw[:200], response.status_code, response.text[:300])
        assert response.status_code < 500, where
        if response.status_code >= 400:
            error = response.json()  # the gateway's shape, or the engine's (passed through)
            assert isinstance(error.get("error"), dict) or error.get("object") == "error", where


def test_fuzzed_requests_never_5xx_and_leave_nothing_reserved(fuzzed: GatewayProcess) -> None:
    tally = Tally()
    started = time.monotonic()
    with httpx.Client(base_url=fuzzed.url, timeout=30) as http:
        for path, raw in corpus():
            tally.check(path, raw, http.post(path, content=raw))
        corpus_sent = tally.sent

        @settings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            derandomize=FUZZ_SEED is None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests())
        def one(request: tuple[str, bytes]) -> None:
            path, raw = request
            tally.check(path, raw, http.post(path, content=raw))

        if FUZZ_SEED is not None:
            one = seed(int(FUZZ_SEED))(one)
        one()
        for raw in RAW_REQUESTS:
            with socket.create_connection(("127.0.0.1", fuzzed.port), timeout=30) as sock:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                answer = sock.recv(65536)
            assert not answer.startswith(b"HTTP/1.1 5"), (raw, answer)
        elapsed = time.monotonic() - started
        generated = tally.sent - corpus_sent
        print(f"\nfuzz: {corpus_sent} corpus + {generated} generated requests in {elapsed:.1f} s")
        print(f"fuzz: answers by status {dict(sorted(tally.by_status.items()))}")
        assert generated >= min(1_000, FUZZ_EXAMPLES)
        if FUZZ_EXAMPLES <= 1_100:
            assert elapsed < 60, "the fuzz suite must stay under a minute in CI"
        # Nothing held once the traffic is over (releases land asynchronously).
        deadline = time.monotonic() + 10
        while True:
            status = http.get("/admin/status").json()
            held = [(e["reserved_blocks"], e["reserved_seqs"]) for e in status["engines"]]
            if all(h == (0, 0) for h in held) and status["queue"]["length"] == 0:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
    log = fuzzed.log_text()
    assert "Traceback" not in log and " ERROR " not in log, fuzzed.log_tail(60)
