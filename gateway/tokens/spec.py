"""``make_counter``: a token counter from its spec string, validated once at start-up.

Specs::

    hf:<dir>                 the tokenizer directory <dir> (tokenizer.json + chat template)
    hf:@tiny                 the project's bundled tiny tokenizer
    tiktoken:<encoding>      an OpenAI encoding loaded offline (cl100k_base)
    engine                   the engine's POST /tokenize, exact, one round trip
    estimate[:<bytes/token>] ceil(utf8 bytes / 4 (or the given ratio)) + template overhead
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from gateway.tokens.chat import MediaTemplate
from gateway.tokens.engine import EngineCounter
from gateway.tokens.errors import TokenizerLoadError
from gateway.tokens.estimate import DEFAULT_BYTES_PER_TOKEN, EstimateCounter
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer
from gateway.tokens.local import HfCounter, TiktokenCounter
from gateway.tokens.protocol import TokenCounter
from gateway.tokens.tiktoken_local import canonical_name, load_encoding

BUNDLED_ALIAS = "@tiny"
SPEC_FORMS = (
    "hf:<dir>, hf:@tiny, tiktoken:<encoding>, engine, estimate or estimate:<bytes_per_token>"
)


def make_counter(
    spec: str,
    *,
    model: str,
    tokenize_urls: Callable[[], list[str]] | None = None,
    client: aiohttp.ClientSession | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
    template_defaults: Mapping[str, Any] | None = None,
    media: MediaTemplate | None = None,
    engine_expands_media: bool = True,
) -> TokenCounter:
    """Build the counter named by ``spec`` for ``model``.

    Loads tokenizers and encodings now (from local files only), so a bad spec fails at
    start-up: raises ``ValueError`` naming the spec and the reason. ``engine`` needs both
    ``tokenize_urls`` (called on every count; it returns the base URLs of the engines serving
    ``model``, best first) and ``client``, an aiohttp session owned and closed by the caller;
    ``timeout``, if given, applies to each ``/tokenize`` call. ``hf:`` renders chats with
    ``template_defaults`` (the engines' ``--default-chat-template-kwargs``) and places media
    as ``media`` says; ``engine_expands_media=False`` makes ``engine`` add the media tokens
    the gateway counted to the engine's answer.
    """
    kind, sep, arg = spec.partition(":")
    try:
        if kind == "hf" and sep and arg:
            return _hf(spec, arg, template_defaults, media)
        if kind == "tiktoken" and sep and arg:
            return TiktokenCounter(load_encoding(arg), name=f"tiktoken:{canonical_name(arg)}")
        if spec == "engine":
            counter = _engine(spec, model, tokenize_urls, client, timeout)
            counter.expands_media = engine_expands_media
            return counter
        if kind == "estimate" and (not sep or arg):
            return _estimate(spec, arg)
    except TokenizerLoadError as exc:
        raise ValueError(f"token counter {spec!r}: {exc}") from exc
    raise ValueError(f"invalid token counter spec {spec!r}; expected one of {SPEC_FORMS}")


def _hf(
    spec: str, arg: str, defaults: Mapping[str, Any] | None, media: MediaTemplate | None
) -> HfCounter:
    directory = BUNDLED_TOKENIZER_DIR if arg == BUNDLED_ALIAS else Path(arg).expanduser()
    if not directory.is_dir():
        raise ValueError(f"token counter {spec!r}: {directory} is not a directory")
    return HfCounter(HfTokenizer.load(directory), name=spec, defaults=defaults, media=media)


def _engine(
    spec: str,
    model: str,
    tokenize_urls: Callable[[], list[str]] | None,
    client: aiohttp.ClientSession | None,
    timeout: aiohttp.ClientTimeout | None,
) -> EngineCounter:
    if tokenize_urls is None or client is None:
        raise ValueError(
            f"token counter {spec!r} for model {model!r} needs tokenize_urls and an "
            "aiohttp.ClientSession"
        )
    return EngineCounter(model=model, urls=tokenize_urls, client=client, timeout=timeout)


def _estimate(spec: str, arg: str) -> EstimateCounter:
    if not arg:
        return EstimateCounter(DEFAULT_BYTES_PER_TOKEN, name=spec)
    try:
        ratio = float(arg)
        return EstimateCounter(ratio, name=spec)
    except ValueError as exc:
        raise ValueError(
            f"token counter {spec!r}: bytes per token must be a positive number, got {arg!r}"
        ) from exc
