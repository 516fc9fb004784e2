"""A chat request as the chat template will see it: messages, tools and template options.

:class:`ChatInput` is what every counter's ``count_chat`` takes. :func:`chat_input` reads it
from an OpenAI chat body the way vLLM 0.32 reads its ``ChatCompletionRequest``
(``vllm/entrypoints/openai/chat_completion/protocol.py``, ``build_chat_params``), and
:func:`conversation` turns the messages into the conversation vLLM renders
(``vllm/renderers/chat_utils.py``, ``parse_chat_messages``): only the fields vLLM keeps, text
parts joined, media parts as placeholders, tool-call arguments parsed into objects.

How the template options combine (vLLM's ``merge_kwargs``: a later value wins unless it is
``None`` or ``"auto"``)::

    request   = chat_template_kwargs ⊕ {documents, reasoning_effort, enable_thinking*}
                                     ⊕ {add_generation_prompt, continue_final_message}
    template  = (engine defaults ⊕ {tools}) ⊕ request

(* ``enable_thinking = reasoning_effort != "none"`` when ``reasoning_effort`` is given and
the client's kwargs do not set it.) ``ChatInput.template_kwargs`` holds the first line without
its last term — the form vLLM's ``/tokenize`` takes as ``chat_template_kwargs`` — so the
``engine`` counter sends it as it is and the ``hf:`` counter merges the rest itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.tokens.errors import InvalidChatRequest
from gateway.tokens.tools import dump_tools

ContentFormat = Literal["string", "openai"]
Modality = Literal["image", "video", "audio"]

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
UNSET = (None, "auto")
"""Values vLLM's ``merge_kwargs`` treats as "not given"."""

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
"""Content parts vLLM reads as text (``TEXT_PART_TYPES``)."""
MEDIA_PART_TYPES: dict[str, Modality] = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}
"""Content parts with media the gateway can count (by size, or at a configured worst case)."""
UNCOUNTABLE_PART_TYPES: dict[str, Modality | None] = {
    "image_embeds": "image",
    "image_pil": "image",
    "video_embeds": "video",
    "audio_embeds": "audio",
    "prompt_embeds": None,
}
"""Content parts vLLM takes whose size the gateway cannot read from the request."""
OTHER_PART_TYPES = frozenset({"tool_reference"})
KNOWN_PART_TYPES = (
    TEXT_PART_TYPES | set(MEDIA_PART_TYPES) | set(UNCOUNTABLE_PART_TYPES) | OTHER_PART_TYPES
)
CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


def merge_kwargs(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: ``overrides`` win, except their ``None``/``"auto"`` values."""
    merged = dict(defaults or {})
    for key, value in (overrides or {}).items():
        if not any(value is unset or value == unset for unset in UNSET):
            merged[key] = value
    return merged


@dataclass(frozen=True, slots=True)
class MediaCount:
    """The tokens one media part of a prompt becomes in the engine (its placeholder
    expanded), as the gateway counted them: ``source`` says how (``"size"`` from the image's
    own dimensions, ``"worst_case"`` from the configured bound, ``"engine"``: left to the
    engine's ``/tokenize``, ``tokens`` unused)."""

    modality: Modality
    tokens: int
    source: Literal["size", "worst_case", "engine"] = "size"


@dataclass(frozen=True, slots=True)
class ChatInput:
    """Everything of a chat request that decides its prompt tokens.

    ``tools`` are already in the form vLLM passes to the template (:func:`dump_tools`);
    ``tool_choice_none`` says the client sent ``tool_choice: "none"`` (an engine started with
    ``--exclude-tools-when-tool-choice-none`` then renders no tools). ``media`` has one entry
    per media part, in order, once the gateway has counted them (empty before).
    """

    messages: Sequence[Mapping[str, Any]]
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice_none: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    mm_processor_kwargs: Mapping[str, Any] | None = None
    media_parts: int = -1
    """Media parts in the messages (-1, the default: count them now)."""
    media: tuple[MediaCount, ...] = ()

    def __post_init__(self) -> None:
        if self.media_parts < 0:
            object.__setattr__(self, "media_parts", count_media_parts(self.messages))

    def without_tools(self) -> ChatInput:
        return dataclasses.replace(self, tools=None)

    def with_media(self, media: tuple[MediaCount, ...]) -> ChatInput:
        return dataclasses.replace(self, media=media)

    def template_variables(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What the template is rendered with, besides ``messages`` and the special tokens:
        ``tools``, ``documents``, ``add_generation_prompt``, ``continue_final_message`` and the
        kwargs (``defaults``: the engine's ``--default-chat-template-kwargs``)."""
        base = merge_kwargs(defaults, {"tools": list(self.tools) if self.tools else None})
        request = merge_kwargs(
            self.template_kwargs,
            {
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
            },
        )
        return merge_kwargs(base, request)

    def tokenize_body(self, model: str, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """vLLM's ``/tokenize`` body for this chat (its ``TokenizeChatRequest``)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": list(messages),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        if self.add_special_tokens:
            body["add_special_tokens"] = True
        if self.tools:
            body["tools"] = list(self.tools)
        if self.chat_template is not None:
            body["chat_template"] = self.chat_template
        if self.template_kwargs:
            body["chat_template_kwargs"] = dict(self.template_kwargs)
        if self.mm_processor_kwargs:
            body["mm_processor_kwargs"] = dict(self.mm_processor_kwargs)
        return body


CHAT_FIELDS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "tool_choice",
        "chat_template",
        "chat_template_kwargs",
        "reasoning_effort",
        "documents",
        "add_special_tokens",
        "mm_processor_kwargs",
    }
)
"""The body fields that change a chat's prompt (the others leave it as plain messages)."""


def chat_input(
    body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], media_parts: int = -1
) -> ChatInput:
    """The :class:`ChatInput` of a chat body whose ``messages`` were checked already
    (``media_parts``: their media parts, when the caller counted them); raises
    :class:`InvalidChatRequest` (with ``param``) for what vLLM would refuse with 400."""
    if CHAT_FIELDS.isdisjoint(body):  # the common case: messages alone
        return ChatInput(messages, media_parts=media_parts)
    agp = _bool(body, "add_generation_prompt", True)
    cfm = _bool(body, "continue_final_message", False)
    if cfm and agp:
        if body.get("add_generation_prompt"):
            message = (
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        else:  # left to its default (True), which transformers refuses beside it
            message = (
                "continue_final_message and add_generation_prompt are not compatible: "
                "set add_generation_prompt to false to continue the final message."
            )
        raise InvalidChatRequest(message, param="continue_final_message")
    tools = dump_tools(body.get("tools"))
    if tools == ():
        raise InvalidChatRequest(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            param="tools",
        )
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise InvalidChatRequest("'chat_template' must be a string", param="chat_template")
    user_kwargs = _object(body, "chat_template_kwargs")
    if user_kwargs is not None:
        if "tools" in user_kwargs:
            user_kwargs = {**user_kwargs, "tools": _kwarg_tools(user_kwargs["tools"])}
        if template is None and isinstance(user_kwargs.get("chat_template"), str):
            template = user_kwargs["chat_template"]
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidChatRequest(
            f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
            param="reasoning_effort",
        )
    extra: dict[str, Any] = {
        "documents": _documents(body.get("documents")),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in (user_kwargs or {}):
        extra["enable_thinking"] = effort != "none"
    return ChatInput(
        messages=messages,
        tools=tools,
        tool_choice_none=body.get("tool_choice") == "none",
        add_generation_prompt=agp,
        continue_final_message=cfm,
        add_special_tokens=_bool(body, "add_special_tokens", False),
        chat_template=template,
        template_kwargs=merge_kwargs(user_kwargs, extra),
        mm_processor_kwargs=_object(body, "mm_processor_kwargs"),
        media_parts=media_parts,
    )


def count_media_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    """Media content parts (of a type vLLM reads as media), in every message."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping):
                    kind = part.get("type")
                    total += kind in MEDIA_PART_TYPES or kind in UNCOUNTABLE_PART_TYPES
    return total


def check_content_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    """Refuse content parts no engine takes (vLLM: "Unsupported chat content part type") and
    text parts without their text, naming the part; return the number of media parts."""
    media = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, str):
                continue
            if not isinstance(part, Mapping):
                raise InvalidChatRequest(
                    f"messages[{i}].content[{j}] must be an object with a 'type'",
                    param="messages",
                )
            kind = part.get("type")
            if kind not in KNOWN_PART_TYPES:
                raise InvalidChatRequest(
                    f"messages[{i}].content[{j}]: unsupported content part type {kind!r}; "
                    f"supported: {', '.join(sorted(KNOWN_PART_TYPES))}",
                    param="messages",
                )
            key = "thinking" if kind == "thinking" else "refusal" if kind == "refusal" else "text"
            if kind in TEXT_PART_TYPES and not isinstance(part.get(key), str | None):
                raise InvalidChatRequest(
                    f"messages[{i}].content[{j}].{key} must be a string", param="messages"
                )
            if kind in ("input_text", "output_text", "thinking") and part.get(key) is None:
                raise InvalidChatRequest(
                    f"messages[{i}].content[{j}].{key} must be a string", param="messages"
                )
            media += kind in MEDIA_PART_TYPES or kind in UNCOUNTABLE_PART_TYPES
    return media


def conversation(
    messages: Sequence[Mapping[str, Any]],
    content_format: ContentFormat,
    placeholders: Mapping[Modality, str] | None = None,
) -> list[dict[str, Any]]:
    """The messages as vLLM renders them (its ``ConversationMessage`` list).

    ``"string"`` content (templates that print ``message['content']``): text parts joined with
    ``"\\n"``, each media part's ``placeholders[modality]`` (the model's own placeholder
    string, e.g. ``<image>``) put before the text, on lines of their own. ``"openai"`` content
    (templates that loop over it): a list of ``{"type": "text", "text"}`` and
    ``{"type": "image"}`` (…) parts. Raises :class:`InvalidChatRequest` for what vLLM refuses.
    """
    converted = [_message(m, i, content_format, placeholders or {}) for i, m in enumerate(messages)]
    _parse_tool_call_arguments(converted)
    return converted


def _message(
    message: Mapping[str, Any],
    index: int,
    content_format: ContentFormat,
    placeholders: Mapping[Modality, str],
) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidChatRequest(f"messages[{index}] is not an object", param="messages")
    role = message.get("role")
    content = message.get("content")
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise InvalidChatRequest(
            f"messages[{index}].content must be a string or a list of parts", param="messages"
        )
    if role == "system":
        parts = _strip_billing_header(parts)
    result: dict[str, Any] = {"role": role}
    if content_format == "openai":
        result["content"] = _openai_content(parts, index)
    else:
        result["content"] = _string_content(parts, index, placeholders)
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            result["tool_calls"] = _tool_calls(tool_calls)
        reasoning = message.get("reasoning")
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        body = result["content"]
        if isinstance(body, list) and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in body
        ):
            texts = [p.get("text", "") for p in body]
            result["content"] = "\n".join(texts) if texts else ""
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _text_of(part: Any) -> str | None:
    """The text of a text part (None: a text or refusal part without text, which vLLM skips)."""
    if isinstance(part, str):
        return part
    kind = part.get("type")
    if kind == "thinking":
        value = part.get("thinking")
    elif kind == "refusal":
        value = part.get("refusal")
    else:
        value = part.get("text")
    return value if isinstance(value, str) else None


def _string_content(parts: list[Any], index: int, placeholders: Mapping[Modality, str]) -> str:
    texts: list[str] = []
    wanted: dict[str, int] = {}
    for part in parts:
        kind = _kind(part)
        if kind in TEXT_PART_TYPES:
            text = _text_of(part)
            if text is not None:
                texts.append(text)
        elif kind == "tool_reference":
            name = part.get("name")
            if isinstance(name, str):
                texts.append(name)
        else:
            _check_known(part, kind, index)
            modality = modality_of(kind)
            placeholder = placeholders.get(modality) if modality else None
            if placeholder:
                wanted[placeholder] = wanted.get(placeholder, 0) + 1
    text = "\n".join(texts)
    if not wanted:
        return text
    # vLLM keeps placeholders the client wrote itself and puts the missing ones first.
    missing: list[str] = []
    for placeholder, count in wanted.items():
        left = count - text.count(placeholder)
        if left < 0:
            raise InvalidChatRequest(
                f"messages[{index}]: found more '{placeholder}' placeholders in the text than "
                "media items",
                param="messages",
            )
        missing.extend([placeholder] * left)
    return "\n".join([*missing, text] if text else missing)


def _kind(part: Any) -> str | None:
    if isinstance(part, str):
        return "text"
    kind = part.get("type") if isinstance(part, Mapping) else None
    return kind if isinstance(kind, str) else None


def modality_of(kind: str | None) -> Modality | None:
    """The modality of a media part type (None: not a media part, or ``prompt_embeds``)."""
    if kind is None:
        return None
    return MEDIA_PART_TYPES.get(kind) or UNCOUNTABLE_PART_TYPES.get(kind)


def _check_known(part: Any, kind: object, index: int) -> None:
    if not isinstance(part, Mapping) or kind not in KNOWN_PART_TYPES:
        shown = kind if isinstance(part, Mapping) else type(part).__name__
        raise InvalidChatRequest(
            f"messages[{index}].content: unsupported content part type {shown!r}",
            param="messages",
        )


def _openai_content(parts: list[Any], index: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in parts:
        kind = _kind(part)
        if kind in TEXT_PART_TYPES:
            text = _text_of(part)
            if text is not None:
                out.append({"type": "text", "text": text})
        elif kind == "tool_reference":
            out.append({"type": "tool_reference", "name": part.get("name")})
        else:
            _check_known(part, kind, index)
            modality = modality_of(kind)
            if modality is not None:
                out.append({"type": modality})
    return out


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's per-request attribution line from system text."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_calls(tool_calls: object) -> Any:
    if not isinstance(tool_calls, list):
        return tool_calls
    calls: list[Any] = []
    for item in tool_calls:
        if isinstance(item, Mapping):
            call = {k: item[k] for k in ("id", "type", "function") if k in item}
            if isinstance(call.get("function"), Mapping):
                call["function"] = dict(call["function"])
            calls.append(call)
        else:
            calls.append(item)
    return calls


def _parse_tool_call_arguments(messages: list[dict[str, Any]]) -> None:
    """vLLM's ``_postprocess_messages``: assistant tool-call arguments become objects (invalid
    JSON, or JSON that is not an object, becomes ``{}``); an empty ``tool_calls`` is dropped."""
    for message in messages:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            continue
        if not calls:
            del message["tool_calls"]
            continue
        for call in calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            if (
                not isinstance(call, Mapping)
                or call.get("type", "function") != "function"
                or not isinstance(function, dict)
            ):
                raise InvalidChatRequest(
                    "chat completions only support assistant tool_calls of type 'function'",
                    param="tool_calls",
                )
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
            elif not isinstance(arguments, dict):
                parsed: Any = None
                if isinstance(arguments, str):
                    try:
                        parsed = json.loads(arguments)
                    except ValueError:
                        parsed = None
                else:
                    parsed = arguments
                function["arguments"] = parsed if isinstance(parsed, dict) else {}


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    if key not in body:
        return default
    value = body[key]
    if not isinstance(value, bool):
        raise InvalidChatRequest(f"'{key}' must be a boolean", param=key)
    return value


def _object(body: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidChatRequest(f"'{key}' must be an object", param=key)
    return value


def _documents(documents: object) -> list[dict[str, str]] | None:
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(
        isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents
    ):
        raise InvalidChatRequest(
            "'documents' must be a list of objects with string values (e.g. title, text)",
            param="documents",
        )
    return documents


def _kwarg_tools(tools: object) -> Any:
    """``chat_template_kwargs.tools`` replaces the request's tools as given (vLLM does not
    validate it); a list of tool objects is checked like ``tools``."""
    if isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools):
        return list(tools)
    if tools is None:
        return None
    raise InvalidChatRequest(
        "'chat_template_kwargs.tools' must be a list of tool objects", param="chat_template_kwargs"
    )


@dataclass(frozen=True, slots=True)
class MediaTemplate:
    """How a model's prompt holds media, for the ``hf:`` counter: the placeholder vLLM writes
    into "string"-format content for each modality (the model's ``get_placeholder_str``, e.g.
    ``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL), and the token in it that
    the processor expands into the item's tokens (``<|image_pad|>``). A modality without a
    pad token is counted as its items' tokens on top of the rendered text (a safe over-count
    by the placeholder's own tokens)."""

    placeholders: Mapping[Modality, str] = field(default_factory=dict)
    pad_tokens: Mapping[Modality, str] = field(default_factory=dict)
