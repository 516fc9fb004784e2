"""Request bodies of vLLM's OpenAI surface: parsing, validation and vLLM's error answers.

Everything here is a decision (a value or an ``ApiError``); the server renders and sends.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.sim.front_door import RefusalReason
from gateway.tokens.chat import ChatInput, chat_input, check_content_parts
from gateway.tokens.errors import InvalidChatRequest, TokenCountError
from gateway.tokens.hf import HfTokenizer

UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)

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


# vLLM's QueueOverflowError and MaxQueuedTokensError (vllm/exceptions.py).
_REFUSAL_MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}


def queue_refusal(reason: RefusalReason) -> ApiError:
    """vLLM's 503 for a front-door refusal: ``type`` is the HTTP phrase, ``param`` null."""
    return ApiError(503, "Service Unavailable", _REFUSAL_MESSAGES[reason])


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages and template options, validated in shape, not yet rendered."""

    messages: tuple[Mapping[str, Any], ...]
    add_generation_prompt: bool
    chat: ChatInput | None = None


@dataclass(frozen=True)
class CompletionPrompts:
    """The prompts of a completions request: each a string or a list of token ids."""

    items: tuple[str | tuple[int, ...], ...]


@dataclass(frozen=True)
class GenerationRequest:
    """A chat or completions request whose fields are valid; ``prompt`` is not rendered yet
    (``render_prompts`` tokenizes it and applies vLLM's length checks)."""

    kind: Literal["chat", "completion"]
    model: str
    prompt: ChatPrompt | CompletionPrompts
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
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from, for errors

    @property
    def num_sequences(self) -> int:
        """Engine sequences this request becomes: ``n`` per prompt."""
        prompts = 1 if isinstance(self.prompt, ChatPrompt) else len(self.prompt.items)
        return prompts * self.n


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
) -> GenerationRequest:
    """The request's fields, checked as vLLM's request models check them (no tokenizer)."""
    model = check_model(body, served_model_name)
    prompt: ChatPrompt | CompletionPrompts
    max_tokens_param = "max_tokens"
    if kind == "chat":
        prompt = chat_messages(body)
        max_tokens = optional_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = optional_int(body, "max_tokens")
        else:
            max_tokens_param = "max_completion_tokens"
    else:
        prompt = _completion_prompts(body.get("prompt"))
        max_tokens = optional_int(body, "max_tokens")
    n = optional_int(body, "n")
    if n is not None and n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    stream = optional_bool(body, "stream") or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", "stream_options")
    if options and not stream:  # as vLLM: empty options are accepted
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = bool(options and optional_bool(options, "include_usage"))
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        n=1 if n is None else n,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=optional_bool(body, "ignore_eos") or False,
        seed=optional_int(body, "seed"),
        cache_salt=cache_salt_of(body),
        default_max_tokens=(
            COMPLETIONS_DEFAULT_MAX_TOKENS
            if kind == "completion" and "max_tokens" not in body
            else None
        ),
        max_tokens_param=max_tokens_param,
    )


def render_prompts(
    request: GenerationRequest,
    *,
    tokenizer: HfTokenizer,
    max_model_len: int,
    max_chars_per_token: int,
) -> tuple[tuple[int, ...], ...]:
    """Token ids of each prompt, or vLLM 0.32's 400 for what cannot fit at all.

    In vLLM's order (``vllm/renderers/params.py``, ``TokenizeParams``): an explicit
    ``max_tokens`` above ``max_model_len``; then, per prompt, a text (or rendered chat) longer
    than ``max_model_len × max_chars_per_token`` characters, refused before tokenization; then
    a prompt of more than ``max_model_len`` tokens. ``max_tokens`` reserves no room here: a
    prompt that fits is accepted and its output is clamped by ``output_budget``. An empty
    prompt (``""`` with a tokenizer that adds no BOS) and token ids out of the vocabulary are
    refused after these checks (vLLM's input processor).
    """
    if request.max_tokens is not None and request.max_tokens > max_model_len:
        param = request.max_tokens_param
        raise bad_request(
            f"{param}={request.max_tokens} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens.",
            param,
        )
    requested = request.max_tokens or 0
    texts: list[str | tuple[int, ...]]
    if isinstance(request.prompt, ChatPrompt):
        texts = [_render_chat(request.prompt, tokenizer)]
    else:
        texts = list(request.prompt.items)
    prompts: list[tuple[int, ...]] = []
    for text in texts:
        if isinstance(text, str):
            _check_text_length(text, requested, max_model_len, max_chars_per_token)
            # vLLM encodes a rendered chat prompt without adding special tokens again.
            add_special = not isinstance(request.prompt, ChatPrompt)
            ids = tuple(tokenizer.encode(text, add_special_tokens=add_special))
        else:
            ids = text
        if len(ids) > max_model_len:
            raise bad_request(
                f"You passed {len(ids)} input tokens and requested {requested} output "
                f"tokens. However, the model's context length is only {max_model_len} "
                f"tokens, resulting in a maximum input length of {max_model_len} tokens. "
                "Please reduce the length of the input prompt.",
                "input_tokens",
            )
        prompts.append(ids)
    for ids in prompts:
        if not ids:  # vLLM's input processor (`_validate_model_input`), answered 400
            raise bad_request("The decoder prompt cannot be empty", "prompt")
        _check_vocabulary(ids, tokenizer)
    return tuple(prompts)


def output_budget(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """Output tokens one sequence of this prompt may generate (vLLM 0.32's ``get_max_tokens``).

    The requested limit clamped to what fits beside the prompt: an explicit ``max_tokens``
    larger than the room left generates up to ``max_model_len`` and ends with ``"length"``.
    An omitted ``max_tokens`` means up to ``max_model_len`` for chat, and 16 (clamped) for
    completions; ``"max_tokens": null`` means up to ``max_model_len`` for both. A prompt that
    fills ``max_model_len`` leaves 0, which vLLM's sampling parameters refuse (400).
    """
    room = max_model_len - num_prompt_tokens
    limit = request.max_tokens if request.max_tokens is not None else request.default_max_tokens
    budget = room if limit is None else min(limit, room)
    if budget < 1:
        raise bad_request(f"max_tokens must be at least 1, got {budget}.", "max_tokens")
    return budget


def parse_tokenize(
    body: Mapping[str, Any], *, served_model_name: str, tokenizer: HfTokenizer
) -> list[int]:
    """Token ids of a ``/tokenize`` body: ``{"prompt": ...}`` or ``{"messages": [...]}`` with
    vLLM's chat fields (``tools``, ``chat_template_kwargs``, ``continue_final_message``...)."""
    if body.get("model") is not None:
        check_model(body, served_model_name)
    if "messages" in body:
        return list(_chat_prompt(body, tokenizer))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (or send 'messages').", "prompt")
    add_special = optional_bool(body, "add_special_tokens")
    return tokenizer.encode(prompt, add_special_tokens=True if add_special is None else add_special)


def chat_messages(body: Mapping[str, Any]) -> ChatPrompt:
    """The ``messages`` of a chat body (with its template options), checked as vLLM checks
    them: roles, content parts, no media, no request template. Not rendered yet."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages.", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role'.", "messages")
    try:
        check_content_parts(messages)
        chat = chat_input(body, messages)
    except InvalidChatRequest as exc:
        raise bad_request(str(exc), exc.param) from exc
    if chat.media_parts:  # a text-only model, as vLLM answers for one
        raise bad_request("This model does not support multimodal inputs.", "messages")
    if chat.chat_template is not None:  # `--trust-request-chat-template` is not set
        raise bad_request(UNTRUSTED_TEMPLATE)
    return ChatPrompt(tuple(messages), chat.add_generation_prompt, chat)


def _render_chat(prompt: ChatPrompt, tokenizer: HfTokenizer) -> str:
    chat = prompt.chat or ChatInput(
        prompt.messages, add_generation_prompt=prompt.add_generation_prompt
    )
    try:
        return tokenizer.render_chat(chat)
    except (TokenCountError, ValueError) as exc:
        raise bad_request(str(exc), "messages") from exc


def _chat_prompt(body: Mapping[str, Any], tokenizer: HfTokenizer) -> tuple[int, ...]:
    # vLLM encodes a rendered chat prompt without adding special tokens again (unless asked).
    prompt = chat_messages(body)
    text = _render_chat(prompt, tokenizer)
    add_special = prompt.chat is not None and prompt.chat.add_special_tokens
    return tuple(tokenizer.encode(text, add_special_tokens=add_special))


def parse_embeddings(
    body: Mapping[str, Any], *, served_model_name: str, tokenizer: HfTokenizer
) -> tuple[str, list[list[int]]]:
    """The model and each input's token ids of a ``/v1/embeddings`` body (``input``: a string,
    strings, token ids or lists of them; or ``messages``, rendered without a generation
    prompt)."""
    model = check_model(body, served_model_name)
    if "messages" in body:
        return model, [list(_chat_prompt({"add_generation_prompt": False, **body}, tokenizer))]
    prompts = _completion_prompts(body.get("input")).items
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if any(not i for i in ids):
        raise bad_request("The input cannot be empty.", "input")
    return model, ids


def parse_detokenize(
    body: Mapping[str, Any], *, served_model_name: str, tokenizer: HfTokenizer
) -> str:
    if body.get("model") is not None:
        check_model(body, served_model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and t >= 0 for t in tokens):
        raise bad_request("'tokens' must be a list of token ids.", "tokens")
    _check_vocabulary(tokens, tokenizer)
    return tokenizer.decode(tokens)


def _completion_prompts(prompt: object) -> CompletionPrompts:
    if isinstance(prompt, str):
        return CompletionPrompts((prompt,))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return CompletionPrompts(tuple(prompt))
        if all(_is_int(t) for t in prompt):
            return CompletionPrompts((tuple(prompt),))
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return CompletionPrompts(tuple(tuple(p) for p in prompt))
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids, and not empty.",
        "prompt",
    )


def _check_text_length(
    text: str, requested: int, max_model_len: int, max_chars_per_token: int
) -> None:
    max_chars = max_model_len * max_chars_per_token
    if len(text) > max_chars:
        # vLLM refuses without even tokenizing: no prompt this long can fit.
        raise bad_request(
            f"You passed {len(text)} input characters and requested {requested} output "
            f"tokens. However, the model's context length is only {max_model_len} tokens, "
            f"resulting in a maximum input length of {max_model_len} tokens (at most "
            f"{max_chars} characters). Please reduce the length of the input prompt.",
            "input_text",
        )


def _check_vocabulary(ids: Sequence[int], tokenizer: HfTokenizer) -> None:
    for token_id in ids:
        if not 0 <= token_id < tokenizer.vocab_size:
            raise bad_request(f"Token id {token_id} is out of vocabulary", "prompt")


def cache_salt_of(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    return salt


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{key}' must be an integer.", key)
    result: int = value
    return result


def optional_bool(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean.", key)
    return value
