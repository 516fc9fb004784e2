"""HfTokenizer on the bundled tiny tokenizer: real files, no mocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.tokens.errors import ChatTemplateError, TokenizerLoadError
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer, bundled_tokenizer_path

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": "parts"}],
    },
]

EXPECTED_RENDER = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHello!<|im_end|>\n"
    "<|im_start|>assistant\nHi.<|im_end|>\n"
    "<|im_start|>user\nTwo\nparts<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok() -> HfTokenizer:
    return HfTokenizer.load(bundled_tokenizer_path())


def test_bundled_asset_is_a_fast_tokenizer_directory() -> None:
    assert bundled_tokenizer_path() == BUNDLED_TOKENIZER_DIR
    config = json.loads((BUNDLED_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    assert isinstance(config["chat_template"], str)
    assert isinstance(config["model_max_length"], int)
    assert (BUNDLED_TOKENIZER_DIR / "special_tokens_map.json").is_file()


def test_vocab_and_special_ids(tok: HfTokenizer) -> None:
    assert tok.vocab_size == 2048
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.special_token_ids == frozenset({0, 1, 2, 3, 4})


@pytest.mark.parametrize(
    "text",
    ["", "a", "Hello, world!", "def f(x):\n    return x * 2\n", "héllo 🙂 日本語", "x" * 5000],
)
def test_encode_adds_no_special_tokens_and_round_trips(tok: HfTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.count(text) == len(ids)
    assert not set(ids) & tok.special_token_ids
    assert tok.decode(ids) == text


def test_special_token_strings_in_text_are_single_ids(tok: HfTokenizer) -> None:
    assert tok.encode("<|im_end|>") == [4]
    assert tok.encode("<|eos|>") == [tok.eos_token_id]


def test_chat_template_renders_chatml(tok: HfTokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATION) == EXPECTED_RENDER


def test_chat_template_without_generation_prompt(tok: HfTokenizer) -> None:
    rendered = tok.apply_chat_template(CONVERSATION[:2], add_generation_prompt=False)
    assert (
        rendered
        == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
    )


def test_count_chat_is_the_rendered_length(tok: HfTokenizer) -> None:
    rendered = tok.apply_chat_template(CONVERSATION)
    assert tok.count_chat(CONVERSATION) == len(tok.encode(rendered, add_special_tokens=False))
    # three ChatML markers per message + "assistant\n" priming: more than the bare text.
    bare = sum(tok.count(m["content"]) for m in CONVERSATION[:3])
    assert tok.count_chat(CONVERSATION) > bare


def test_none_content_renders_empty(tok: HfTokenizer) -> None:
    rendered = tok.apply_chat_template([{"role": "assistant", "content": None}], False)
    assert rendered == "<|im_start|>assistant\n<|im_end|>\n"


@pytest.mark.parametrize(
    "content",
    [[{"type": "hologram", "hologram": "x"}], [42], 42],
)
def test_unknown_content_is_rejected(tok: HfTokenizer, content: object) -> None:
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"role": "user", "content": content}])


def test_content_parts_render_as_vllm_joins_them(tok: HfTokenizer) -> None:
    # vLLM: plain strings in a list are text, a text part without text is skipped, media
    # parts of a text model render nothing (the counters count them apart: ChatInput.media).
    content = ["loose", {"type": "text"}, {"type": "image_url", "image_url": {"url": "x"}}, "end"]
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], False)
    assert rendered == "<|im_start|>user\nloose\nend<|im_end|>\n"


def _write_dir(tmp_path: Path, template: object) -> Path:
    (tmp_path / "tokenizer.json").write_text((BUNDLED_TOKENIZER_DIR / "tokenizer.json").read_text())
    config: dict[str, object] = {
        "bos_token": {"content": "<|bos|>", "__type": "AddedToken"},
        "eos_token": "<|eos|>",
    }
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_template_sees_special_tokens_and_raise_exception(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{{ m['content'] | tojson }}{% generation %}!{% endgeneration %}"
        "{% endfor %}{{ eos_token }}"
    )
    tok = HfTokenizer.load(_write_dir(tmp_path, template))
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<|bos|>"é"!<|eos|>'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_trim_and_lstrip_blocks_like_transformers(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if true %}\n"
        "[{{ m['content'] }}]\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    tok = HfTokenizer.load(_write_dir(tmp_path, template))
    assert (
        tok.apply_chat_template([{"role": "u", "content": "a"}, {"role": "u", "content": "b"}])
        == "[a]\n[b]\n"
    )


def test_named_template_list_uses_default(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = HfTokenizer.load(_write_dir(tmp_path, templates))
    assert tok.apply_chat_template([]) == "D"


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    directory = _write_dir(tmp_path, "from config")
    (directory / "chat_template.jinja").write_text("from file")
    assert HfTokenizer.load(directory).apply_chat_template([]) == "from file"


def test_no_template_fails_only_for_chat(tmp_path: Path) -> None:
    tok = HfTokenizer.load(_write_dir(tmp_path, None))
    assert tok.encode("abc")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.count_chat([{"role": "user", "content": "x"}])


def test_missing_directory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        HfTokenizer.load(tmp_path / "nowhere")


def test_bad_template_syntax_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="does not compile"):
        HfTokenizer.load(_write_dir(tmp_path, "{% for %}"))
