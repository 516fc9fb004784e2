import json

from gateway.usage import TAIL, UsageMeter


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


def test_completion_tokens_are_the_engines_own_count():
    whole = UsageMeter(streaming=False, prompt_tokens=999)  # the gateway's count may differ
    whole.feed(json.dumps({"usage": {"completion_tokens": 7, "total_tokens": 17}}).encode())
    assert (whole.completion_tokens(), whole.total_tokens()) == (7, 17)
    stream = UsageMeter(streaming=True, prompt_tokens=999)
    stream.feed(sse(*({"choices": [{"text": "x"}]} for _ in range(3))))
    assert stream.completion_tokens() == stream.streamed_tokens == 3  # events, until told
    stream.feed(sse({"choices": [], "usage": {"completion_tokens": 4, "total_tokens": 14}}))
    assert (stream.completion_tokens(), stream.total_tokens()) == (4, 14)


def test_continuous_usage_stats_count_the_stream_as_it_goes():
    m = UsageMeter(streaming=True, prompt_tokens=10)
    for n in range(1, 6):  # every event carries the running usage, as vLLM's option does
        m.feed(sse({"choices": [{"text": "xy"}], "usage": {"completion_tokens": 2 * n}}))
        assert m.streamed_tokens == 2 * n


def test_a_whole_answer_is_parsed_once(monkeypatch):
    """Both figures are read at the end of every request: one JSON parse of the body."""
    import gateway.usage

    calls = []
    real = gateway.usage._usage
    monkeypatch.setattr(gateway.usage, "_usage", lambda p: calls.append(p) or real(p))
    m = UsageMeter(streaming=False, prompt_tokens=3)
    m.feed(json.dumps({"usage": {"completion_tokens": 4, "total_tokens": 7}}).encode())
    assert (m.total_tokens(), m.completion_tokens(), m.total_tokens()) == (7, 4, 7)
    assert len(calls) == 1


def test_a_chat_streams_opening_role_events_are_not_tokens():
    """vLLM opens a chat stream with one role-only event per choice (`content` empty)."""
    m = UsageMeter(streaming=True, prompt_tokens=10)
    opening = [
        {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]} for i in (0, 1)
    ]
    tokens = [{"choices": [{"index": i % 2, "delta": {"content": "x"}}]} for i in range(6)]
    # pydantic's compact JSON, as vLLM writes it
    events = [json.dumps(e, separators=(",", ":")).encode() for e in opening + tokens]
    m.feed(sse(*events, b"[DONE]"))
    assert m.completion_tokens() == 6
    assert m.total_tokens() == 16


def test_a_whole_answer_over_the_parse_limit_still_gives_its_usage():
    """Large answers (n × long outputs with logprobs) are where usage matters most; vLLM
    writes `usage` after the choices, so the meter keeps the answer's end."""
    from gateway.usage import MAX_BODY

    big = "x" * (2 * MAX_BODY)
    body = json.dumps(
        {
            "choices": [{"text": big, "logprobs": {"tokens": ['"usage"']}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4000, "total_tokens": 4010},
        }
    ).encode()
    m = UsageMeter(streaming=False, prompt_tokens=10)
    for i in range(0, len(body), 65_536):
        m.feed(body[i : i + 65_536])
    assert (m.total_tokens(), m.completion_tokens()) == (4010, 4000)


def test_an_endless_stream_event_is_held_only_up_to_the_tail_and_usage_still_read():
    """Issue 38: a stream event without its end was held whole (and copied at each chunk);
    a stream with a 1 MiB event keeps at most TAIL bytes of it, and the usage after it is
    read as usual."""
    m = UsageMeter(streaming=True, prompt_tokens=10)
    m.feed(b"data: " + b"x" * 1024)
    for _ in range(1024):
        m.feed(b"x" * 1024)
        assert len(m._tail) <= TAIL
    m.feed(b"\n\n" + sse({"choices": [], "usage": {"total_tokens": 42}}, b"[DONE]"))
    assert m.total_tokens() == 42


def named(kind, data):
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def test_a_responses_stream_is_metered_by_its_named_events():
    """vLLM's Responses stream names each event (`event:` then `data:`): the deltas are its
    tokens as it goes, `response.completed` carries the usage; the events before it carry
    `"usage": null` and are not tokens. (It was metered as 0 tokens: only `data:`-first
    events were read.)"""
    created = {"type": "response.created", "response": {"id": "resp_1", "usage": None}}
    delta = {"type": "response.output_text.delta", "delta": "x"}
    done = {
        "type": "response.completed",
        "response": {
            "id": "resp_1",
            "usage": {"input_tokens": 10, "output_tokens": 4, "total_tokens": 14},
        },
    }
    stream = (
        named("response.created", created)
        + named("response.in_progress", created)
        + b"".join(named("response.output_text.delta", delta) for _ in range(4))
        + named("response.output_text.done", {"type": "response.output_text.done", "text": "x"})
    )
    m = UsageMeter(streaming=True, prompt_tokens=10)
    for i in range(0, len(stream), 11):
        m.feed(stream[i : i + 11])
    assert m.streamed_tokens == 4  # as it goes, before the usage
    m.feed(named("response.completed", done))
    assert m.completion_tokens() == 4 and m.total_tokens() == 14
