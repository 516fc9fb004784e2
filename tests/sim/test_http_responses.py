"""The Responses API of the simulator (``POST /v1/responses``), over HTTP: vLLM's shapes and
events, the conversation of ``previous_response_id``, the bounded store, the OpenAI client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from gateway.sim.response_store import ResponseStore, StoredResponse
from gateway.stored_responses import response_facts
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from tests.sim.conftest import SimFactory, state, wait_idle

TOKENIZER = HfTokenizer.load(BUNDLED_TOKENIZER_DIR)
USER = {"role": "user", "content": "How many blocks does this take?"}
STREAM_ORDER_HEAD = ["response.created", "response.in_progress"]
TEXT_OPENING = ["response.output_item.added", "response.content_part.added"]
TEXT_CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def events_of(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a named-event SSE stream, checking vLLM's framing."""
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        name = event_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await client.post(f"{url}/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


async def test_a_text_input_is_one_user_message(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim() as url:
        body = {"model": "tiny", "input": USER["content"], "max_output_tokens": 6}
        answer = await post(client, url, {**body, "ignore_eos": True, "seed": 3})
        assert answer["id"].startswith("resp_") and answer["object"] == "response"
        assert answer["model"] == "tiny" and isinstance(answer["created_at"], int)
        # Cut at max_output_tokens: vLLM's "incomplete", with its reason.
        assert answer["status"] == "incomplete"
        assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
        assert answer["max_output_tokens"] == 6
        (item,) = answer["output"]
        assert item["id"].startswith("msg_") and item["type"] == "message"
        assert item["role"] == "assistant" and item["status"] == "completed"
        (part,) = item["content"]
        assert part["type"] == "output_text" and part["annotations"] == [] and part["text"]
        usage = answer["usage"]
        assert usage["input_tokens"] == TOKENIZER.count_chat([USER])
        assert usage["output_tokens"] == 6
        assert usage["total_tokens"] == usage["input_tokens"] + 6
        assert usage["input_tokens_details"] == {"cached_tokens": 0}
        assert usage["output_tokens_details"]["reasoning_tokens"] == 0
        # The same engine model as chat: the same messages and seed generate the same text.
        chat = {"model": "tiny", "messages": [USER], "max_tokens": 6, "ignore_eos": True}
        reply = (await client.post(f"{url}/v1/chat/completions", json={**chat, "seed": 3})).json()
        assert reply["choices"][0]["message"]["content"] == part["text"]
        # Ended by EOS: "completed", no details; EOS counted, not in the text.
        natural = await post(client, url, {**body, "max_output_tokens": 96, "seed": 1})
        assert natural["status"] == "completed" and natural["incomplete_details"] is None


async def test_a_message_list_with_instructions(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim() as url:
        items = [
            {"role": "user", "content": [{"type": "input_text", "text": "first question"}]},
            {"type": "message", "role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
        ]
        answer = await post(
            client,
            url,
            {"input": items, "instructions": "Be brief.", "max_output_tokens": 3},
        )
        chat = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
        ]
        assert answer["usage"]["input_tokens"] == TOKENIZER.count_chat(chat)
        assert answer["instructions"] == "Be brief."


async def test_streamed_events_in_order_with_the_id_first(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim() as url:
        body = {"input": "stream me", "max_output_tokens": 5, "ignore_eos": True, "seed": 9}
        async with client.stream(
            "POST", f"{url}/v1/responses", json={**body, "stream": True}
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = (await resp.aread()).decode()
        events = events_of(raw)
        names = [name for name, _ in events]
        assert names == [
            *STREAM_ORDER_HEAD,
            *TEXT_OPENING,
            *["response.output_text.delta"] * 5,
            *TEXT_CLOSING,
        ]
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        created = events[0][1]["response"]
        assert created["id"].startswith("resp_") and created["status"] == "in_progress"
        assert created["output"] == [] and created["usage"] is None
        deltas = "".join(data["delta"] for name, data in events if name.endswith(".delta"))
        assert events[-4][1]["text"] == deltas
        final = events[-1][1]["response"]
        assert final["id"] == created["id"] and final["status"] == "incomplete"
        assert final["output"][0]["content"][0]["text"] == deltas
        assert final["output"][0]["id"] == events[2][1]["item"]["id"]
        usage = final["usage"]
        assert usage["output_tokens"] == 5
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        # What the gateway reads of it (gateway/stored_responses.py): the id in the first
        # bytes, the total tokens in the last ones; the same for the whole answer.
        data = raw.encode()
        assert response_facts(data[:4096], data[-4096:]) == (created["id"], usage["total_tokens"])
        whole = (await client.post(f"{url}/v1/responses", json=body)).content
        got = json.loads(whole)
        assert got["output"][0]["content"][0]["text"] == deltas  # the same seeded text
        assert response_facts(whole[:4096], whole[-4096:]) == (
            got["id"],
            got["usage"]["total_tokens"],
        )


async def test_previous_response_id_prepends_the_conversation(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim() as url:
        first = await post(
            client, url, {"input": "My name is Ada.", "instructions": "Be kind.", "seed": 2}
        )
        text = first["output"][0]["content"][0]["text"] if first["output"][0]["content"] else ""
        second = await post(
            client,
            url,
            {"input": "What is my name?", "previous_response_id": first["id"], "seed": 2},
        )
        assert second["previous_response_id"] == first["id"]
        # The previous input and output, then the new input; the old instructions do not
        # carry over (vLLM drops the stored system messages).
        chat = [{"role": "user", "content": "My name is Ada."}]
        if text:
            chat.append({"role": "assistant", "content": text})
        chat.append({"role": "user", "content": "What is my name?"})
        assert second["usage"]["input_tokens"] == TOKENIZER.count_chat(chat)
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        # A chain: the third turn carries both earlier ones.
        third = await post(client, url, {"input": "And?", "previous_response_id": second["id"]})
        assert third["usage"]["input_tokens"] > second["usage"]["total_tokens"]


async def test_an_unknown_or_unstored_previous_response_is_404(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim() as url:
        missing = await client.post(
            f"{url}/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"}
        )
        assert missing.status_code == 404
        assert missing.json() == {
            "error": {
                "message": "Response with id 'resp_nope' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
        unstored = await post(client, url, {"input": "x", "store": False, "max_output_tokens": 2})
        again = {"input": "y", "previous_response_id": unstored["id"]}
        assert (await client.post(f"{url}/v1/responses", json=again)).status_code == 404
        assert (await state(client, url))["stored_responses"] == 0
    async with sim(max_stored_responses=0) as url:  # vLLM's default: nothing is stored
        stored = await post(client, url, {"input": "x", "max_output_tokens": 2})
        again = {"input": "y", "previous_response_id": stored["id"]}
        assert (await client.post(f"{url}/v1/responses", json=again)).status_code == 404


async def test_the_store_is_bounded_least_recently_used_first_out(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(max_stored_responses=3) as url:
        ids = []
        for i in range(3):
            answer = await post(client, url, {"input": f"turn {i}", "max_output_tokens": 2})
            ids.append(answer["id"])
        # Using the oldest refreshes it; the new answer then pushes out the next oldest.
        follow = {"input": "more", "previous_response_id": ids[0], "max_output_tokens": 2}
        ids.append((await post(client, url, follow))["id"])
        st = await state(client, url)
        assert (st["stored_responses"], st["max_stored_responses"]) == (3, 3)
        probe = {"input": "x", "max_output_tokens": 2, "store": False}
        gone = {**probe, "previous_response_id": ids[1]}
        assert (await client.post(f"{url}/v1/responses", json=gone)).status_code == 404
        for kept in (ids[0], ids[2], ids[3]):
            body = {**probe, "previous_response_id": kept}
            assert (await client.post(f"{url}/v1/responses", json=body)).status_code == 200
        assert (await state(client, url))["stored_responses"] == 3


def test_the_store_alone() -> None:
    store = ResponseStore(capacity=2)
    for key in "abc":
        store.put(key, StoredResponse(({"role": "user", "content": key},), key))
    assert len(store) == 2 and store.get("a") is None
    assert store.get("b") is not None  # refreshed: "c" is now the oldest
    store.put("d", StoredResponse((), ""))
    assert store.get("c") is None and store.get("b") is not None
    nothing = ResponseStore(capacity=0)
    nothing.put("a", StoredResponse((), ""))
    assert len(nothing) == 0 and nothing.get("a") is None
    with pytest.raises(ValueError):
        ResponseStore(capacity=-1)


async def test_responses_run_through_the_engine_model(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    """One sequence each, scheduled like any other: max_num_seqs holds, blocks are taken and
    freed, prefix-cache hits are reported."""
    async with sim(max_num_seqs=1, block_size=4, decode_ms_base=5) as url:
        body = {"input": USER["content"], "max_output_tokens": 4, "ignore_eos": True}
        answers = await asyncio.gather(*(post(client, url, body) for _ in range(3)))
        st = await wait_idle(client, url)
        assert st["peak_running"] == 1 and st["used_blocks"] == 0
        assert all(a["usage"]["output_tokens"] == 4 for a in answers)
        # The same prompt after the first: its full blocks come from the prefix cache (the
        # last prompt token is always computed).
        cached = sorted(a["usage"]["input_tokens_details"]["cached_tokens"] for a in answers)
        prompt = answers[0]["usage"]["input_tokens"]
        assert cached == [0, (prompt - 1) // 4 * 4, (prompt - 1) // 4 * 4]


async def test_a_disconnect_aborts_and_stores_nothing(
    sim: SimFactory, client: httpx.AsyncClient
) -> None:
    async with sim(decode_ms_base=20) as url:
        body = {"input": "long", "max_output_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/responses", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break  # gone after the first event
        st = await wait_idle(client, url)
        assert st["used_blocks"] == 0 and st["stored_responses"] == 0


RESPONSES_ERRORS: list[tuple[dict[str, Any], int, str, str]] = [
    ({"model": "nope", "input": "x"}, 404, "NotFoundError", "The model `nope` does not exist."),
    ({"instructions": "no input"}, 400, "BadRequestError", "'input'"),
    ({"input": 5}, 400, "BadRequestError", "'input' must be a string or a list"),
    ({"input": [{"type": "function_call_output"}]}, 400, "BadRequestError", "not modelled"),
    ({"input": "x", "max_output_tokens": 0}, 400, "BadRequestError", "at least 1, got 0"),
    ({"input": "x", "max_output_tokens": 65}, 400, "BadRequestError", "max_output_tokens=65"),
    ({"input": "x", "store": "yes"}, 400, "BadRequestError", "'store'"),
]


async def test_errors_have_vllm_shape(sim: SimFactory, client: httpx.AsyncClient) -> None:
    async with sim(max_model_len=64, num_gpu_blocks=16) as url:
        for body, status, error_type, message in RESPONSES_ERRORS:
            reply = await client.post(f"{url}/v1/responses", json=body)
            assert reply.status_code == status, body
            error = reply.json()["error"]
            assert error["type"] == error_type and error["code"] == status
            assert message in error["message"], (error, message)
    # A prompt that fills the context: the Responses path's own message (vLLM checks it
    # before the output limit).
    fills = TOKENIZER.count_chat([USER])
    async with sim(max_model_len=fills, num_gpu_blocks=fills) as url:
        reply = await client.post(f"{url}/v1/responses", json={"input": USER["content"]})
        assert reply.status_code == 400
        assert reply.json()["error"] == {
            "message": f"The engine prompt length {fills} exceeds the max_model_len {fills}. "
            "Please reduce prompt.",
            "type": "invalid_request_error",
            "param": "input",
            "code": 400,
        }


async def test_the_openai_client(sim: SimFactory) -> None:
    async with sim() as url:
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        first = await api.responses.create(
            model="tiny",
            input="Say something.",
            instructions="Be brief.",
            max_output_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert first.id.startswith("resp_") and first.status == "incomplete"
        assert first.output_text and first.usage is not None
        assert first.usage.output_tokens == 8
        assert first.usage.total_tokens == first.usage.input_tokens + 8
        stream = await api.responses.create(
            model="tiny",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "More."}]}],
            previous_response_id=first.id,
            max_output_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        kinds, deltas, completed = [], "", None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
            if event.type == "response.completed":
                completed = event.response
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert completed is not None and completed.output_text == deltas
        assert completed.usage is not None
        assert completed.usage.input_tokens > first.usage.total_tokens
        assert completed.previous_response_id == first.id
        await api.close()
