"""Request bodies of vLLM's OpenAI surface: parsing, validation and vLLM's error answers.

Everything here is a decision (a value or an ``ApiError``); the server renders and sends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.tokens.errors import TokenCountError
from gateway.tokens.hf import HfTokenizer

# vLLM's CompletionRequest default; chat requests default to "up to max_model_len".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class ApiError(Exception):
    """An answer in vLLM's current error shape ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, error_type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "BadRequestError", message, param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, "NotFoundError", f"The model `{model}` does not exist.", "model")


@dataclass(frozen=True)
class GenerationRequest:
    """A validated chat or completions request; ``prompts`` are token ids, one per prompt."""

    kind: Literal["chat", "completion"]
    model: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    seed: int | None
    # The limit when ``max_tokens`` is None: 16 for completions that left it out (vLLM's
    # default), None (up to ``max_model_len``) for chat and for an explicit null.
    default_max_tokens: int | None = None
    cache_salt: str | None = None  # mixed into the prefix cache's first block hash


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def check_model(body: Mapping[str, Any], served_model_name: str) -> str:
    model = body.get("model", served_model_name)
    if model is None:
        return served_model_name
    if not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    if model != served_model_name:
        raise model_not_found(model)
    return model


def parse_generation(
    kind: Literal["chat", "completion"],
    body: Mapping[str, Any],
    *,
    served_model_name: str,
    tokenizer: HfTokenizer,
) -> GenerationRequest:
    model = check_model(body, served_model_name)
    if kind == "chat":
        prompts: tuple[tuple[int, ...], ...] = (_chat_prompt(body, tokenizer),)
        max_tokens = _optional_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _optional_int(body, "max_tokens")
    else:
        prompts = _completion_prompts(body.get("prompt"), tokenizer)
        max_tokens = _optional_int(body, "max_tokens")
    n = _optional_int(body, "n")
    if n is not None and n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    stream = _optional_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options")
    if options and not stream:  # as vLLM: empty options are accepted
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = bool(options and _optional_bool(options, "include_usage"))
    return GenerationRequest(
        kind=kind,
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_optional_bool(body, "ignore_eos") or False,
        seed=_optional_int(body, "seed"),
        cache_salt=_cache_salt(body),
        default_max_tokens=(
            COMPLETIONS_DEFAULT_MAX_TOKENS
            if kind == "completion" and "max_tokens" not in body
            else None
        ),
    )


def output_budget(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """Output tokens one sequence of this prompt may generate, or vLLM's 400.

    A prompt alone reaching ``max_model_len``, or an explicit ``max_tokens`` that does not fit
    beside the prompt, is a 400 (vLLM 0.32 clamps the latter instead; most versions answer
    400). An omitted ``max_tokens`` means up to ``max_model_len`` for chat, and 16 (clamped to
    what fits) for completions, as in vLLM; ``"max_tokens": null`` means up to
    ``max_model_len`` for both.
    """
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages."
        )
    room = max_model_len - num_prompt_tokens
    if request.max_tokens is None:
        default = request.default_max_tokens
        return room if default is None else min(default, room)
    if request.max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {request.max_tokens} output tokens and your prompt contains "
            f"{num_prompt_tokens} input tokens, for a total of "
            f"{num_prompt_tokens + request.max_tokens} tokens. Please reduce the length of the "
            "input prompt or the number of requested output tokens."
        )
    return request.max_tokens


def parse_tokenize(
    body: Mapping[str, Any], *, served_model_name: str, tokenizer: HfTokenizer
) -> list[int]:
    """Token ids of a ``/tokenize`` body: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
    if body.get("model") is not None:
        check_model(body, served_model_name)
    if "messages" in body:
        return list(_chat_prompt(body, tokenizer))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (or send 'messages').", "prompt")
    add_special = _optional_bool(body, "add_special_tokens")
    return tokenizer.encode(prompt, add_special_tokens=True if add_special is None else add_special)


def _chat_prompt(body: Mapping[str, Any], tokenizer: HfTokenizer) -> tuple[int, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role'.", "messages")
    add_generation_prompt = _optional_bool(body, "add_generation_prompt")
    try:
        rendered = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
        )
    except (TokenCountError, ValueError) as exc:
        raise bad_request(str(exc), "messages") from exc
    # vLLM encodes a rendered chat prompt without adding special tokens again.
    return tuple(tokenizer.encode(rendered, add_special_tokens=False))


def _completion_prompts(prompt: object, tokenizer: HfTokenizer) -> tuple[tuple[int, ...], ...]:
    if isinstance(prompt, str):
        return (tuple(tokenizer.encode(prompt)),)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return tuple(tuple(tokenizer.encode(p)) for p in prompt)
        if all(_is_int(t) for t in prompt):
            return (_token_prompt(prompt, tokenizer),)
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return tuple(_token_prompt(p, tokenizer) for p in prompt)
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids, and not empty.",
        "prompt",
    )


def _token_prompt(ids: list[Any], tokenizer: HfTokenizer) -> tuple[int, ...]:
    for token_id in ids:
        if not 0 <= token_id < tokenizer.vocab_size:
            raise bad_request(f"Token id {token_id} is out of vocabulary", "prompt")
    return tuple(ids)


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    return salt


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{key}' must be an integer.", key)
    result: int = value
    return result


def _optional_bool(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean.", key)
    return value
