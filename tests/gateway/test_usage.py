import json

from gateway.usage import UsageMeter


def sse(*events):
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def test_non_streaming_reads_usage():
    m = UsageMeter(streaming=False, prompt_tokens=10)
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 10, "total_tokens": 17}}).encode()
    m.feed(body[:5])
    m.feed(body[5:])
    assert m.total_tokens() == 17


def test_stream_with_usage_event_split_across_chunks():
    stream = sse(
        {"choices": [{"text": "a"}]},
        {"choices": [{"text": "b"}]},
        {"choices": [], "usage": {"total_tokens": 12}},
        b"[DONE]",
    )
    m = UsageMeter(streaming=True, prompt_tokens=10)
    for i in range(0, len(stream), 7):
        m.feed(stream[i : i + 7])
    assert m.total_tokens() == 12


def test_stream_without_usage_counts_events():
    m = UsageMeter(streaming=True, prompt_tokens=10)
    m.feed(sse(*({"choices": [{"text": "x"}]} for _ in range(5)), b"[DONE]"))
    assert m.total_tokens() == 15


def test_garbage_gives_none():
    m = UsageMeter(streaming=False, prompt_tokens=1)
    m.feed(b"not json")
    assert m.total_tokens() is None
