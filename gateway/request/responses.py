"""`/v1/responses` bodies (the Responses API, served by vLLM): its input as chat messages.

The footprint the gateway reserves for a Responses request is stated, not exact:

- the prompt is `instructions` (a system message) and `input` (a string is one user message;
  `message` items keep their role and text; `function_call` items become an assistant tool
  call and `function_call_output` items a tool message, as vLLM builds them; `reasoning` and
  other items add no text) rendered with the model's chat template and the request's
  function `tools` (in the chat form `{"type": "function", "function": {...}}`);
- with `previous_response_id`, the engine prepends the stored conversation, which the gateway
  does not hold: it adds the total tokens (input + output) that response used, as its answer
  reported them (0 when the gateway never saw that response);
- the output is `max_output_tokens`, else the rest of the context.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.request.body import bad, int_field, model_of, stream_of
from gateway.request.generation import check_messages
from gateway.request.inbound import Inbound
from gateway.tokens.chat import chat_input
from gateway.tokens.errors import InvalidChatRequest

TEXT_ITEM_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})


def parse_responses(body: dict[str, Any]) -> Inbound:
    model = model_of(body)
    stream = stream_of(body)
    max_out = int_field(body, "max_output_tokens", minimum=1)
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise bad("'previous_response_id' must be a non-empty string", "previous_response_id")
    messages = _messages(body)
    if not messages:
        raise bad("you must provide an 'input'", "input")
    checked = check_messages(messages)
    chat_body: dict[str, Any] = {"tools": _tools(body.get("tools"))}
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat_body["chat_template_kwargs"] = body["chat_template_kwargs"]
    try:
        chat = chat_input(chat_body, checked)
    except InvalidChatRequest as e:
        raise bad(str(e), e.param) from None
    return Inbound(
        "responses",
        model,
        stream,
        1,
        max_out,
        messages=checked,
        chat=chat,
        previous_response_id=previous,
    )


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    if not isinstance(given, list):
        raise bad("'input' must be a string or a list of items", "input")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise bad(f"input[{i}] must be an object", "input")
        message = _item(item, i)
        if message is not None:
            messages.append(message)
    return messages


def _item(item: dict[str, Any], index: int) -> dict[str, Any] | None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str):
            raise bad(f"input[{index}].role must be a string", "input")
        return {"role": role, "content": _item_content(item.get("content"), index)}
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else json.dumps(output)
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": text}
    return None  # reasoning and other items: no prompt text of their own here


def _item_content(content: object, index: int) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"input[{index}].content must be a string or a list of parts", "input")
    parts: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            raise bad(f"input[{index}].content has a part that is not an object", "input")
        kind = part.get("type")
        if kind in TEXT_ITEM_PARTS:
            text = part.get("text", part.get("refusal"))
            parts.append({"type": "text", "text": text if isinstance(text, str) else ""})
        elif kind == "input_image":
            parts.append({"type": "input_image", "image_url": part.get("image_url")})
        else:
            parts.append(part)  # refused by the content-part check, with its type named
    return parts


def _tools(tools: object) -> list[dict[str, Any]] | None:
    """Function tools in the chat form (vLLM converts them the same way); other tool types
    (web search, MCP...) render nothing here."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}] must be an object", "tools")
        if tool.get("type") != "function":
            continue
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        converted.append({"type": "function", "function": function})
    return converted or None
