"""A Hugging Face tokenizer directory, loaded with ``tokenizers`` and Jinja2 (no ``transformers``).

:class:`HfTokenizer` reads ``<dir>/tokenizer.json`` and the chat template of the directory and
counts tokens the way a vLLM engine serving that directory does:

- completions: ``encode(prompt)`` with the tokenizer's own special tokens
  (``add_special_tokens=True``, vLLM's default for ``/v1/completions``);
- chat: the conversation as vLLM builds it (:mod:`gateway.tokens.chat`) is rendered like
  ``transformers.apply_chat_template`` (:mod:`gateway.tokens.template`) — with the request's
  tools, documents, template kwargs, ``continue_final_message`` — and the rendered text is
  encoded with ``add_special_tokens=False`` (unless the request asks for them), as vLLM does
  for chat, because the template already wrote every special token the model needs.

Message content is passed to the template as vLLM passes it: as one string (text parts joined
with ``"\\n"``) for templates that print ``message['content']``, as a list of parts for
templates that loop over it (vLLM's "string" and "openai" content formats, detected from the
template).

The project's own tokenizer (byte-level BPE, vocab 2048, a ChatML template that renders tools
as Qwen2.5 and Hermes do, no automatic BOS) is bundled at :data:`BUNDLED_TOKENIZER_DIR`;
``tools/build_tokenizer.py`` builds it.

Instances are immutable after :meth:`HfTokenizer.load` and safe to share between threads
(``tokenizers`` encodes without holding the GIL); compiled templates are reused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gateway.tokens.chat import ChatInput, Modality, conversation
from gateway.tokens.errors import ChatTemplateError, TokenizerLoadError
from gateway.tokens.template import (
    compile_template,
    content_format,
    named_templates,
    render,
    select_template,
)

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
        chat_template: str | Mapping[str, str] | None,
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
        if isinstance(chat_template, str):
            chat_template = {"default": chat_template}
        self.chat_templates: dict[str, str] = dict(chat_template or {})
        """The tokenizer's chat templates by name (``default``, maybe ``tool_use``...)."""
        for source in self.chat_templates.values():
            compile_template(source)  # a template that does not compile fails the load
        self.chat_template = self.chat_templates.get("default")
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
        saves it there; ``additional_chat_templates/<name>.jinja`` add named ones), else
        ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name",
        "template"}``). A directory without a template loads; only chat rendering then fails.
        Raises :class:`TokenizerLoadError`.
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
            chat_template=_find_chat_templates(directory, config),
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

    def encoding(self, text: str, *, add_special_tokens: bool = True) -> Any:
        """The ``tokenizers.Encoding`` of ``text``, without offsets where the library allows
        (``len()`` is the count; ``.ids`` builds the id list only when read)."""
        if self._encode_fast is not None:
            return self._encode_fast([text], add_special_tokens=add_special_tokens)[0]
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Token ids of a text pair with the tokenizer's pair template (cross-encoders'
        ``[CLS] a [SEP] b [SEP]``; plain concatenation for tokenizers without one)."""
        ids: list[int] = self._tokenizer.encode(first, second, add_special_tokens=True).ids
        return ids

    def count(self, text: str, *, add_special_tokens: bool = True) -> int:
        """``len(encode(text, add_special_tokens=...))``, without computing offsets (about a
        third faster than ``encode`` on large inputs)."""
        return len(self.encoding(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Byte-level pieces that do not form valid UTF-8 decode to U+FFFD."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form, e.g. ``Ġworld``), or None."""
        token: str | None = self._tokenizer.id_to_token(token_id)
        return token

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self._tokenizer.token_to_id(token)
        return token_id

    def render_chat(
        self,
        chat: ChatInput,
        *,
        defaults: Mapping[str, Any] | None = None,
        placeholders: Mapping[Modality, str] | None = None,
    ) -> str:
        """The prompt text of a chat request, as vLLM renders it for this tokenizer.

        ``defaults`` are the engine's ``--default-chat-template-kwargs``; ``placeholders`` the
        model's media placeholder strings (for "string"-format templates). Raises
        :class:`ChatTemplateError` (a ``ValueError``) when there is no template, a message is
        malformed, or the template refuses the conversation.
        """
        variables = {**self._special_tokens, **chat.template_variables(defaults)}
        source = select_template(
            self.chat_templates, chat.chat_template, bool(variables.get("tools"))
        )
        if source is None:
            raise ChatTemplateError(f"tokenizer {self._source} has no chat template")
        messages = conversation(chat.messages, content_format(source), placeholders)
        return render(source, messages, variables)

    def chat_encoding(
        self,
        chat: ChatInput,
        *,
        defaults: Mapping[str, Any] | None = None,
        placeholders: Mapping[Modality, str] | None = None,
    ) -> Any:
        """The encoding of a chat prompt (see :meth:`encoding`)."""
        rendered = self.render_chat(chat, defaults=defaults, placeholders=placeholders)
        return self.encoding(rendered, add_special_tokens=chat.add_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` alone (no tools, no options), as ``transformers`` would with
        ``tokenize=False``. Raises :class:`ChatTemplateError`."""
        return self.render_chat(ChatInput(messages, add_generation_prompt=add_generation_prompt))

    def count_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> int:
        """Prompt tokens of ``messages`` alone: the rendered template encoded without adding
        special tokens again (what vLLM's ``/tokenize`` and chat endpoints count)."""
        return len(
            self.chat_encoding(ChatInput(messages, add_generation_prompt=add_generation_prompt))
        )

    def _token_id(self, key: str) -> int | None:
        token = self._special_tokens.get(key)
        if token is None:
            return None
        return self.token_to_id(token)


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


def _find_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates = {"default": jinja_file.read_text(encoding="utf-8")}
        extra = directory / "additional_chat_templates"
        if extra.is_dir():
            for path in sorted(extra.glob("*.jinja")):
                templates[path.stem] = path.read_text(encoding="utf-8")
        return templates
    return named_templates(config.get("chat_template"), str(directory))


def _added_tokens(tokenizer: Tokenizer) -> Iterable[tuple[int, Any]]:
    decoder: dict[int, Any] = tokenizer.get_added_tokens_decoder()
    return decoder.items()
