"""Exceptions raised by token counting.

Every error here derives from :class:`TokenCountError`, so the service can map the whole family
to one HTTP answer. Errors caused by the request itself (bad prompt type, a template that rejects
the messages) also derive from :class:`ValueError`; errors of the gateway's own set-up or of an
upstream engine do not.
"""

from __future__ import annotations


class TokenCountError(Exception):
    """Base class of every error raised by ``gateway.tokens``."""


class TokenizerLoadError(TokenCountError):
    """A tokenizer or encoding could not be loaded from local files (never downloaded)."""


class ChatTemplateError(TokenCountError, ValueError):
    """The messages could not be rendered: no template, bad content parts, or the template raised
    (``raise_exception``) on them. The request is at fault, so this is also a ``ValueError``."""


class InvalidChatRequest(ChatTemplateError):
    """A chat field the counters read (``tools``, ``chat_template_kwargs``, a content part...)
    is malformed, in the way vLLM would refuse it too. ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTypeError(TokenCountError, ValueError):
    """A completions ``prompt`` of a type the OpenAI API does not allow."""


class EngineTokenizeError(TokenCountError):
    """No engine answered ``POST /tokenize`` usefully: every URL failed (``attempts`` says how),
    or an engine answered 4xx (``status``; its message is in the text) or a body without a
    valid ``count``. ``detail`` is the engine's own error message, without its URL."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        attempts: tuple[str, ...] = (),
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.attempts = attempts
        self.detail = detail
