"""A request's ``tools`` as vLLM hands them to the chat template.

vLLM validates each tool into its request model (``ChatCompletionToolsParam`` with a
``FunctionDefinition``) and passes ``tool.model_dump()`` to the template, so the template sees
the model's fields, not the client's JSON: ``description`` and ``parameters`` appear as
``None`` when the client left them out, unknown keys are dropped, ``strict`` and
``defer_loading`` appear only when set, and a tool-level ``defer_loading`` is copied into its
function. A template that prints ``tool | tojson`` prints exactly that (vLLM 0.32,
``vllm/entrypoints/openai/chat_completion/protocol.py``,
``vllm/entrypoints/generate/base/protocol.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.tokens.errors import InvalidChatRequest


def dump_tools(tools: object, *, param: str = "tools") -> tuple[dict[str, Any], ...] | None:
    """``tools`` as vLLM dumps them, or None for ``null``; raises :class:`InvalidChatRequest`
    naming the tool and field for anything vLLM's request model would refuse."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidChatRequest(f"'{param}' must be a list of tools", param=param)
    return tuple(_dump_tool(tool, i, param) for i, tool in enumerate(tools))


def _dump_tool(tool: object, index: int, param: str) -> dict[str, Any]:
    where = f"{param}[{index}]"
    if not isinstance(tool, Mapping):
        raise InvalidChatRequest(f"{where} must be an object", param=param)
    kind = tool.get("type", "function")
    if kind != "function":
        raise InvalidChatRequest(
            f"{where}.type must be 'function', got {_shown(kind)}", param=param
        )
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidChatRequest(f"{where}.function must be an object", param=param)
    name = function.get("name")
    if not isinstance(name, str):
        raise InvalidChatRequest(f"{where}.function.name must be a string", param=param)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidChatRequest(
            f"{where}.function.description must be a string or null", param=param
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidChatRequest(
            f"{where}.function.parameters must be an object (a JSON schema) or null",
            param=param,
        )
    strict = _optional_bool(function, "strict", f"{where}.function", param)
    deferred = _optional_bool(function, "defer_loading", f"{where}.function", param)
    tool_deferred = _optional_bool(tool, "defer_loading", where, param)
    if tool_deferred is not None and deferred is None:
        deferred = tool_deferred
    dumped_function: dict[str, Any] = {
        "name": name,
        "description": description,
        "parameters": dict(parameters) if parameters is not None else None,
    }
    if strict is not None:
        dumped_function["strict"] = strict
    if deferred is not None:
        dumped_function["defer_loading"] = deferred
    dumped: dict[str, Any] = {"type": "function", "function": dumped_function}
    if tool_deferred is not None:
        dumped["defer_loading"] = tool_deferred
    return dumped


def _optional_bool(obj: Mapping[str, Any], key: str, where: str, param: str) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise InvalidChatRequest(f"{where}.{key} must be a boolean or null", param=param)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "…"
