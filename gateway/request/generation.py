"""`/v1/chat/completions` and `/v1/completions` bodies: the fields admission reads.

Checked here, before anything is counted or reserved: `stream`, `stream_options`, `n`,
`max_tokens`, `max_completion_tokens`, `messages` (roles, content parts: unknown part types
are refused as vLLM refuses them), `prompt`, and for chat the template inputs the counters
read (`tools`, `tool_choice`, `chat_template`, `chat_template_kwargs`, `documents`,
`add_generation_prompt`, `continue_final_message`, `reasoning_effort`,
`mm_processor_kwargs`; see `gateway.tokens.chat`). Fields it does not read pass through to
the engine unchecked: vLLM has many extensions.
"""

from __future__ import annotations

from typing import Any

from gateway.request.body import MAX_INT, MAX_N, bad, int_field, model_of, stream_of
from gateway.request.inbound import Inbound, Kind
from gateway.tokens.chat import chat_input, check_content_parts
from gateway.tokens.errors import InvalidChatRequest

# vLLM's `/v1/completions` generates 16 tokens when `max_tokens` is left out (OpenAI's legacy
# default); `"max_tokens": null` means up to the context's end, as for chat.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of message objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        if not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}].role must be a string", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad(f"messages[{i}].content must be a string or a list of parts", "messages")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(f"messages[{i}].content[{j}] must be an object with a 'type'", "messages")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content[{j}].text must be a string", "messages")
    return messages


def check_prompt(prompt: Any, param: str = "prompt") -> Any:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt
        if all(_is_token_id(p) for p in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return prompt
    raise bad(
        f"'{param}' must be a string, a list of strings, a list of token ids (integers from 0 "
        f"to {MAX_INT}) or a list of lists of token ids (none empty)",
        param,
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` in the shape every chat endpoint needs; raises `BadRequest`."""
    return checked_messages(messages)[0]


def checked_messages(messages: Any) -> tuple[list[dict[str, Any]], int]:
    """`check_messages`, and the number of media parts in them."""
    checked = _check_messages(messages)
    try:
        return checked, check_content_parts(checked)
    except InvalidChatRequest as e:
        raise bad(str(e), e.param) from None


def _prefix_salt(body: dict[str, Any]) -> bytes | None:
    """`Inbound.prefix_salt`: the `cache_salt`, or None when vLLM reads no cache for it."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise bad("'cache_salt' must be a string", "cache_salt")
    if body.get("prompt_logprobs") is not None:
        return None
    return (salt or "").encode()


def parse_generation(body: dict[str, Any], kind: Kind) -> Inbound:
    """Check a chat or completions body; raise `BadRequest` with the field named."""
    model = model_of(body)
    stream = stream_of(body)
    n = int_field(body, "n", minimum=1, maximum=MAX_N) or 1
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if options and not stream:
        # vLLM refuses it too (400); caught here, it costs no reservation.
        raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
    if kind == "chat":
        max_out = int_field(body, "max_completion_tokens", minimum=1)
        if max_out is None:
            max_out = int_field(body, "max_tokens", minimum=1)
        messages, media = checked_messages(body.get("messages"))
        try:
            chat = chat_input(body, messages, media)
        except InvalidChatRequest as e:
            raise bad(str(e), e.param) from None
        return Inbound(
            kind,
            model,
            stream,
            n,
            max_out,
            messages=messages,
            chat=chat,
            prefix_salt=_prefix_salt(body),
        )
    if "prompt" not in body:
        raise bad("you must provide a 'prompt'", "prompt")
    # vLLM 0.32's completions read `max_tokens` only; other versions may honour
    # `max_completion_tokens` there too: the larger of the two is reserved.
    fields = ("max_tokens", "max_completion_tokens")
    max_out = max(
        (v for v in (int_field(body, f, minimum=1) for f in fields) if v is not None),
        default=None,
    )
    default = (
        COMPLETIONS_DEFAULT_MAX_TOKENS if max_out is None and "max_tokens" not in body else None
    )
    return Inbound(
        kind,
        model,
        stream,
        n,
        max_out,
        prompt=check_prompt(body["prompt"]),
        default_output_tokens=default,
        prefix_salt=_prefix_salt(body),
    )
