"""A Hugging Face tokenizer directory, loaded with ``tokenizers`` and Jinja2 (no ``transformers``).

:class:`HfTokenizer` reads ``<dir>/tokenizer.json`` and the chat template of the directory and
counts tokens the way a vLLM engine serving that directory does:

- completions: ``encode(prompt)`` with the tokenizer's own special tokens
  (``add_special_tokens=True``, vLLM's default for ``/v1/completions``);
- chat: the template is rendered like ``transformers.apply_chat_template`` (sandboxed Jinja2,
  ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``) and the
  rendered text is encoded with ``add_special_tokens=False``, as vLLM does for chat, because the
  template already wrote every special token the model needs.

Message ``content`` may be a string, ``None`` (rendered as ``""``) or a list of OpenAI content
parts; text parts are joined with ``"\\n"`` into one string before rendering. This is vLLM's
"string" content format, which vLLM picks for templates that do not iterate over
``message['content']`` (the bundled ChatML template, and most templates). Non-text parts are
rejected with :class:`ChatTemplateError`: a text-only tokenizer cannot count them.

The project's own tokenizer (byte-level BPE, vocab 2048, ChatML, no automatic BOS) is bundled at
:data:`BUNDLED_TOKENIZER_DIR`; ``tools/build_tokenizer.py`` builds it.

Instances are immutable after :meth:`HfTokenizer.load` and safe to share between threads
(``tokenizers`` encodes without holding the GIL); the compiled template is reused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from tokenizers import Tokenizer

from gateway.tokens.errors import ChatTemplateError, TokenizerLoadError
from gateway.tokens.messages import content_text

BUNDLED_TOKENIZER_DIR: Path = Path(__file__).resolve().parent.parent / "assets" / "tiny-tokenizer"
"""The project's tiny tokenizer directory, shipped as package data."""

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def bundled_tokenizer_path() -> Path:
    """Path of the bundled tiny tokenizer directory (``hf:`` spec: ``hf:<this path>``)."""
    return BUNDLED_TOKENIZER_DIR


class HfTokenizer:
    """One tokenizer directory: encode/decode, chat template rendering and counting."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        source: str = "<memory>",
    ) -> None:
        self._tokenizer = tokenizer
        # tokenizers >= 0.20: batch encoding that skips offset tracking.
        self._encode_fast: Callable[..., list[Any]] | None = getattr(
            tokenizer, "encode_batch_fast", None
        )
        self._special_tokens = dict(special_tokens)
        self._source = source
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template is not None else None
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        """Size of the id space, added tokens included (``len(tokenizer)`` in transformers)."""
        self.bos_token_id = self._token_id("bos_token")
        self.eos_token_id = self._token_id("eos_token")
        self.pad_token_id = self._token_id("pad_token")
        self.special_token_ids: frozenset[int] = frozenset(
            token_id for token_id, tok in _added_tokens(tokenizer) if tok.special
        )
        """Ids of the special added tokens (a generator of plain text should avoid them)."""

    @classmethod
    def load(cls, path: str | Path) -> HfTokenizer:
        """Load ``tokenizer.json`` and the chat template from a tokenizer directory.

        The template comes from ``chat_template.jinja`` if present (newer ``transformers``
        saves it there), else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list
        of ``{"name", "template"}`` of which ``default`` is used). A directory without a template
        loads; only chat rendering then fails. Raises :class:`TokenizerLoadError`.
        """
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"no tokenizer.json in {directory}")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        special = {
            key: value
            for key in _SPECIAL_TOKEN_KEYS
            if (value := _token_content(config.get(key))) is not None
        }
        return cls(
            tokenizer,
            chat_template=_find_chat_template(directory, config),
            special_tokens=special,
            source=str(directory),
        )

    def __repr__(self) -> str:
        return f"HfTokenizer({self._source!r}, vocab_size={self.vocab_size})"

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``... as strings, passed to the template like transformers."""
        return dict(self._special_tokens)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` runs the tokenizer's post-processor
        (BOS/EOS for some models; nothing for the bundled tokenizer). Special-token strings in
        ``text`` (e.g. ``<|im_end|>``) become their single ids, as in transformers."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        """``len(encode(text, add_special_tokens=...))``, without computing offsets (about a
        third faster than ``encode`` on large inputs)."""
        if self._encode_fast is not None:
            return len(self._encode_fast([text], add_special_tokens=add_special_tokens)[0])
        return len(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Byte-level pieces that do not form valid UTF-8 decode to U+FFFD."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form, e.g. ``Ġworld``), or None."""
        token: str | None = self._tokenizer.id_to_token(token_id)
        return token

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the chat template, as ``transformers`` would with
        ``tokenize=False``. Raises :class:`ChatTemplateError` when there is no template, a
        message is malformed, or the template rejects the conversation."""
        if self._template is None:
            raise ChatTemplateError(f"tokenizer {self._source} has no chat template")
        conversation = [_normalize_message(m, i) for i, m in enumerate(messages)]
        try:
            return self._template.render(
                messages=conversation,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on the messages: {exc!r}") from exc

    def count_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> int:
        """Prompt tokens of a chat request: the rendered template encoded without adding
        special tokens again (what vLLM's ``/tokenize`` and chat endpoints count)."""
        rendered = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.count(rendered, add_special_tokens=False)

    def _token_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        if token is None:
            return None
        token_id: int | None = self._tokenizer.token_to_id(token)
        return token_id


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} is not a JSON object")
    return data


def _token_content(value: object) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as serialized AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _find_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise TokenizerLoadError(f"{directory}: chat_template list has no 'default' template")
    raise TokenizerLoadError(f"{directory}: chat_template is neither a string nor a list")


def _added_tokens(tokenizer: Tokenizer) -> Iterable[tuple[int, Any]]:
    decoder: dict[int, Any] = tokenizer.get_added_tokens_decoder()
    return decoder.items()


def _normalize_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}] is not an object")
    normalized = dict(message)
    normalized["content"] = content_text(message.get("content"), index)
    return normalized


# --- the Jinja2 environment of transformers' apply_chat_template -------------------------------


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


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from exc
