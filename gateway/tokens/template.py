"""Chat templates rendered as ``transformers.apply_chat_template`` renders them for vLLM.

- The Jinja2 environment of transformers (sandboxed, ``trim_blocks``/``lstrip_blocks``,
  ``raise_exception``, a ``tojson`` that does not HTML-escape, ``strftime_now``,
  ``{% generation %}``, loop controls).
- :func:`content_format`: vLLM's detection of whether a template loops over
  ``message['content']`` (``"openai"``: content stays a list of parts) or prints it
  (``"string"``: text parts joined), ported from ``vllm/renderers/hf.py``.
- :func:`render`: ``continue_final_message`` as transformers 5 does it — a tag appended to
  the final message's text, the rendering cut where the tag lands — and vLLM's conversion of
  ``developer`` messages for templates that do not know that role.

Compiled templates are cached by their source (per-request templates included: at most
``TEMPLATE_CACHE`` of them, as vLLM bounds its own cache).
"""

from __future__ import annotations

import copy
import functools
import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from gateway.tokens.chat import ContentFormat
from gateway.tokens.errors import ChatTemplateError, TokenizerLoadError

TEMPLATE_CACHE = 32
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' marker for the end of the message to continue."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces Jinja's tojson (which HTML-escapes) with a plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    # Templates may print today's date; that is the only wall-clock read here, by design of
    # the template, and it never changes the token count by more than the date's length.
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers uses it to mark
    assistant tokens; counting does not need the mask)."""

    tags = {"generation"}  # noqa: RUF012 - the Extension API defines it as a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@functools.lru_cache(maxsize=TEMPLATE_CACHE)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached by source); raises :class:`TokenizerLoadError`."""
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from exc


@functools.lru_cache(maxsize=TEMPLATE_CACHE)
def content_format(source: str) -> ContentFormat:
    """``"openai"`` when the template loops over a message's content, else ``"string"``
    (vLLM's ``_detect_content_format``; a template that does not parse is ``"string"``)."""
    try:
        ast = _ENV.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    try:
        next(_content_loops(ast))
    except StopIteration:
        return "string"
    return "openai"


def knows_developer_role(source: str) -> bool:
    """vLLM's test: a template that never names the ``developer`` role gets developer
    messages as system messages."""
    return '"developer"' in source or "'developer'" in source


def render(
    source: str,
    conversation: list[dict[str, Any]],
    variables: Mapping[str, Any],
) -> str:
    """The rendered prompt. ``variables`` are the template's keyword arguments (special
    tokens, ``tools``, ``documents``, ``add_generation_prompt``, ``continue_final_message``,
    the chat template kwargs). Raises :class:`ChatTemplateError` when the template or
    transformers' checks refuse the conversation."""
    template = compile_template(source)
    if any(m.get("role") == "developer" for m in conversation) and not knows_developer_role(source):
        conversation = _developer_as_system(conversation)
    values = dict(variables)
    continue_key = values.pop("continue_final_message", False)
    documents = values.get("documents")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise ChatTemplateError("Documents should be a list of dicts with 'title' and 'text' keys!")
    tools = values.get("tools")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError("Tools should be JSON schemas (objects)")
    if not continue_key:
        return _render(template, conversation, values)
    if values.get("add_generation_prompt"):
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt are not compatible"
        )
    key = continue_key if isinstance(continue_key, str) else "content"
    conversation = copy.deepcopy(conversation)
    final = _tag_final_message(conversation, key, source)
    rendered = _render(template, conversation, values)
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the tag's trailing space


def _render(
    template: jinja2.Template, conversation: list[dict[str, Any]], values: Mapping[str, Any]
) -> str:
    try:
        return template.render(messages=conversation, **values)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
    except (TypeError, KeyError, AttributeError, ValueError, IndexError) as exc:
        raise ChatTemplateError(f"chat template failed on the messages: {exc!r}") from exc


def _tag_final_message(conversation: list[dict[str, Any]], key: str, source: str) -> str:
    """Append the tag to the final message's ``key`` (its last text part); return the text."""
    if not conversation:
        raise ChatTemplateError("continue_final_message is set but there is no final message")
    final_message = conversation[-1].get(key)
    if final_message is None:
        raise ChatTemplateError(
            f'continue_final_message is set but the final message has no "{key}" to continue!'
        )
    if key not in source:
        raise ChatTemplateError(
            f'continue_final_message is set to "{key}" but this is not an accepted field in '
            "the chat_template"
        )
    if isinstance(final_message, list | tuple):
        for block in reversed(final_message):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + CONTINUE_TAG
                return str(text)
        raise ChatTemplateError(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    conversation[-1][key] = final_message + CONTINUE_TAG
    return str(final_message)


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_convert_developer_to_system`` then ``_consolidate_system_messages``."""
    converted = []
    for message in conversation:
        if message.get("role") == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    consolidate = False
    for i, message in enumerate(converted):
        if message.get("role") != "system":
            others.append(message)
            continue
        if i > 0 or contents:
            consolidate = True
        content = message.get("content", "")
        if isinstance(content, list):
            texts = [p if isinstance(p, str) else _text(p) for p in content]
            content = "\n".join(str(t) for t in texts if t is not None)
        if content:
            contents.append(content)
    if not consolidate:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def select_template(
    templates: Mapping[str, str], requested: str | None, has_tools: bool
) -> str | None:
    """The template source to render with: a per-request template (or the name of one of the
    tokenizer's named templates), else the tokenizer's ``tool_use`` template when tools are
    given and it has one, else its ``default`` (transformers' ``get_chat_template``)."""
    if requested is not None:
        return templates.get(requested, requested)
    if has_tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")


# --- vLLM's detection of content loops (vllm/renderers/hf.py), ported ------------------------


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root: jinja2.nodes.Node, name: str) -> Iterator[str]:
    yield name
    pending = deque([name])
    while pending:
        related = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, related) and isinstance(
                assign.target, jinja2.nodes.Name
            ):
                yield assign.target.name
                if assign.target.name != related:
                    pending.append(assign.target.name)


def _message_names(root: jinja2.nodes.Node) -> list[str]:
    messages = list(_names_bound_to(root, "messages"))
    names: list[str] = []
    for loop in root.find_all(jinja2.nodes.For):
        for name in messages:
            if _is_var_or_elems(loop.iter, name) and isinstance(loop.target, jinja2.nodes.Name):
                names.append(loop.target.name)
                break
    return names


def _content_loops(root: jinja2.nodes.Node) -> Iterator[jinja2.nodes.For]:
    names = _message_names(root)
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, n, "content") for n in names):
                    content_params.add(macro.args[i].name)
            for kwarg in call.kwargs:
                if kwarg.key in params and any(
                    _is_var_or_elems(kwarg.value, n, "content") for n in names
                ):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, n, "content") for n in names):
            yield loop
            continue
        macro_params = params_by_loop.get(id(loop))
        if isinstance(loop.iter, jinja2.nodes.Name) and (
            (macro_params is not None and loop.iter.name in macro_params)
            or (id(loop) not in in_macros and loop.iter.name == "content")
        ):
            yield loop


def named_templates(config_template: object, source: str) -> dict[str, str]:
    """``tokenizer_config.json``'s ``chat_template`` as ``{name: template}``: a string is the
    ``default``; a list of ``{"name", "template"}`` keeps every name. Raises
    :class:`TokenizerLoadError` for any other form (``source`` names the file)."""
    if config_template is None:
        return {}
    if isinstance(config_template, str):
        return {"default": config_template}
    if isinstance(config_template, list):
        named: dict[str, str] = {}
        for entry in config_template:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                template = entry.get("template")
                if isinstance(template, str):
                    named[entry["name"]] = template
        if not named:
            raise TokenizerLoadError(f"{source}: chat_template list has no named template")
        return named
    raise TokenizerLoadError(f"{source}: chat_template is neither a string nor a list")


def _text(part: object) -> str | None:
    return part.get("text") if isinstance(part, dict) else None
