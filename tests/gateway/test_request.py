import json

import pytest

from gateway.errors import BadRequest
from gateway.request import parse_body


def body(**kw):
    return json.dumps(kw).encode()


def test_chat_fields():
    inbound = parse_body(
        body(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2, stream=True
        ),
        "chat",
    )
    assert (inbound.model, inbound.max_output_tokens, inbound.n, inbound.stream) == (
        "m",
        5,
        2,
        True,
    )


def test_completions_default_to_16_output_tokens_as_vllm_does():
    left_out = parse_body(body(model="m", prompt="hi"), "completion")
    assert (left_out.max_output_tokens, left_out.default_output_tokens) == (None, 16)
    # An explicit null: vLLM generates up to the end of the context.
    null = parse_body(body(model="m", prompt="hi", max_tokens=None), "completion")
    assert (null.max_output_tokens, null.default_output_tokens) == (None, None)
    given = parse_body(body(model="m", prompt="hi", max_tokens=40), "completion")
    assert (given.max_output_tokens, given.default_output_tokens) == (40, None)
    # vLLM 0.32's completions ignore `max_completion_tokens`, other versions may not: the
    # larger of the two is reserved, whichever the engine reads.
    for mt, mct in ((2000, 10), (10, 2000)):
        both = parse_body(
            body(model="m", prompt="hi", max_tokens=mt, max_completion_tokens=mct), "completion"
        )
        assert (both.max_output_tokens, both.default_output_tokens) == (2000, None)
    only = parse_body(body(model="m", prompt="hi", max_completion_tokens=40), "completion")
    assert (only.max_output_tokens, only.default_output_tokens) == (40, None)
    # Chat has no such default: left out means up to the end of the context.
    chat = parse_body(body(model="m", messages=[{"role": "user", "content": "x"}]), "chat")
    assert (chat.max_output_tokens, chat.default_output_tokens) == (None, None)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_options_without_stream_are_refused_as_vllm_does(kind):
    fields = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    with pytest.raises(BadRequest, match="stream=True") as err:
        parse_body(body(model="m", stream_options={"include_usage": True}, **fields), kind)
    assert err.value.body()["error"]["param"] == "stream_options"
    # Empty options are falsy to vLLM too: accepted.
    assert parse_body(body(model="m", stream_options={}, **fields), kind).stream is False


def test_max_completion_tokens_wins_over_max_tokens():
    inbound = parse_body(
        body(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            max_completion_tokens=9,
        ),
        "chat",
    )
    assert inbound.max_output_tokens == 9


@pytest.mark.parametrize(
    "prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]], ids=["str", "strs", "ids", "id-lists"]
)
def test_prompt_forms(prompt):
    assert parse_body(body(model="m", prompt=prompt), "completion").prompt == prompt


@pytest.mark.parametrize(
    ("raw", "kind", "match"),
    [
        (b"{not json", "chat", "not valid JSON"),
        (b"[1, 2]", "chat", "JSON object"),
        (body(messages=[{"role": "user", "content": "x"}]), "chat", "model"),
        (body(model=3, messages=[]), "chat", "model"),
        (body(model="m", messages=[]), "chat", "non-empty"),
        (body(model="m", messages="hi"), "chat", "non-empty"),
        (body(model="m", messages=[{"content": "x"}]), "chat", "role"),
        (body(model="m", messages=[{"role": "user", "content": 5}]), "chat", "content"),
        (
            body(model="m", messages=[{"role": "u", "content": "x"}], max_tokens=-1),
            "chat",
            "at least 1",
        ),
        (
            body(model="m", messages=[{"role": "u", "content": "x"}], max_tokens="9"),
            "chat",
            "integer",
        ),
        (
            body(model="m", messages=[{"role": "u", "content": "x"}], max_tokens=True),
            "chat",
            "integer",
        ),
        (body(model="m", messages=[{"role": "u", "content": "x"}], n=0), "chat", "at least 1"),
        (body(model="m", messages=[{"role": "u", "content": "x"}], n=1000), "chat", "at most"),
        (
            body(model="m", messages=[{"role": "u", "content": "x"}], stream="yes"),
            "chat",
            "boolean",
        ),
        (body(model="m"), "completion", "prompt"),
        (body(model="m", prompt=[]), "completion", "prompt"),
        (body(model="m", prompt=[1, "a"]), "completion", "prompt"),
        (body(model="m", prompt=5), "completion", "prompt"),
    ],
)
def test_bad_bodies_are_400_with_reason(raw, kind, match):
    with pytest.raises(BadRequest, match=match) as err:
        parse_body(raw, kind)
    assert err.value.status == 400
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}


def nested(depth: int, inner: str = "1") -> bytes:
    """`{"model": "m", ..., "x": [[...[1]...]]}`: the body `depth` levels deep in all."""
    tail = json.dumps(chat())[:-1]
    return f'{tail}, "x": {"[" * (depth - 1)}{inner}{"]" * (depth - 1)}}}'.encode()


@pytest.mark.parametrize(
    ("raw", "kind", "match"),
    [
        # Deeper than the interpreter's recursion limit: json.loads raises RecursionError.
        (nested(1_000), "chat", "nests deeper than 64"),
        (nested(100_000), "chat", "nests deeper than 64"),
        (b"[" * 5_000, "chat", "nests deeper than 64|not valid JSON"),
        (nested(65), "chat", "nests deeper than 64"),
        # Lone surrogates: escaped, or encoded in the bytes (json.loads would pass both).
        (body(model="m", messages=[{"role": "user", "content": "\ud800"}]), "chat", "surrogate"),
        (body(model="m", prompt="a\udfffb"), "completion", "surrogate"),
        (body(model="m", prompt=["ok", "\udc00"]), "completion", "surrogate"),
        (body(model="m", prompt="x", user={"\ud800": 1}), "completion", "surrogate"),
        (b'{"model": "m", "prompt": "\xed\xa0\x80"}', "completion", "UTF-8"),
        (b'{"model": "m", "prompt": "\xff"}', "completion", "UTF-8"),
        ('{"model": "m", "prompt": "x"}'.encode("utf-16"), "completion", "UTF-8"),
        (b'{"model": "m", "prompt": "x", "temperature": NaN}', "completion", "NaN"),
        (b'{"model": "m", "prompt": "x", "top_p": -Infinity}', "completion", "Infinity"),
        (
            b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
            "completion",
            "JSON",
        ),
        (json.dumps(chat(max_tokens=2**31)).encode(), "chat", "at most"),
        (json.dumps(chat(max_tokens=10**400)).encode(), "chat", "at most"),
        (json.dumps(chat(max_tokens=1.5)).encode(), "chat", "integer"),
        (json.dumps(chat(stream_options="yes", stream=True)).encode(), "chat", "stream_options"),
        (body(model="m", messages=[{"role": "u", "content": ["x"]}]), "chat", r"content\[0\]"),
        (body(model="m", messages=[{"role": "u", "content": [{}]}]), "chat", r"content\[0\]"),
        (
            body(model="m", messages=[{"role": "u", "content": [{"type": "text", "text": 5}]}]),
            "chat",
            r"content\[0\]\.text",
        ),
        (body(model="m", prompt=[-1, 2]), "completion", "prompt"),
        (body(model="m", prompt=[[2**40]]), "completion", "prompt"),
    ],
)
def test_hostile_bodies_are_400_before_anything_is_counted(raw, kind, match):
    with pytest.raises(BadRequest, match=match):
        parse_body(raw, kind)


def test_valid_unicode_and_unknown_fields_pass():
    """Surrogate pairs (escaped by ensure_ascii) are one code point; unknown fields pass to the
    engine whatever they hold, nested up to the limit."""
    raw = json.dumps(chat(user="😀 \\ud800 as text", vllm_xargs={"a": [[[[1]]]]}, top_k=None))
    assert "\\ud83d\\ude00" in raw
    assert parse_body(raw.encode(), "chat").messages == [{"role": "user", "content": "x"}]
    assert parse_body(nested(64), "chat").model == "m"
    assert parse_body(nested(65), "chat", max_depth=65).model == "m"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"a": [{}]}}}
    many = json.dumps(chat(tools=[tool] * 500)).encode()  # wide, not deep
    assert parse_body(many, "chat").model == "m"
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert parse_body(body(model="m", messages=[{"role": "u", "content": parts}]), "chat")
