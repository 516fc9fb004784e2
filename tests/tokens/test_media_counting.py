"""Media parts in the counters: placeholders rendered where vLLM puts them, then expanded into
the tokens the media counter found; never counted as nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from gateway.media import FAMILIES
from gateway.tokens import BUNDLED_TOKENIZER_DIR, HfTokenizer, make_counter
from gateway.tokens.chat import ChatInput, MediaCount
from gateway.tokens.local import HfCounter

QWEN = FAMILIES["qwen2_vl"].template
IMAGE = {"type": "image_url", "image_url": {"url": "data:,x"}}
VIDEO = {"type": "video_url", "video_url": {"url": "http://v"}}


@pytest.fixture(scope="module")
def vl_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    """The bundled tokenizer plus Qwen2-VL's vision tokens, as a VL model's tokenizer has."""
    directory = tmp_path_factory.mktemp("vl-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(BUNDLED_TOKENIZER_DIR / name, directory / name)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    return HfTokenizer.load(directory)


def chat(*parts: dict[str, object], media: tuple[MediaCount, ...] = ()) -> ChatInput:
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]
    return ChatInput(messages).with_media(media)


async def test_placeholders_expand_into_the_counted_tokens(vl_tokenizer: HfTokenizer) -> None:
    counter = HfCounter(vl_tokenizer, name="hf:vl", media=QWEN)
    text_only = (await counter.count_chat(chat())).count
    one = chat(IMAGE, media=(MediaCount("image", 391),))
    rendered = vl_tokenizer.render_chat(one, placeholders=QWEN.placeholders)
    # vLLM's "string" content: the placeholder on its own line before the text.
    assert "<|vision_start|><|image_pad|><|vision_end|>\nWhat is it?" in rendered
    ids = vl_tokenizer.encode(rendered, add_special_tokens=False)
    assert ids.count(vl_tokenizer.token_to_id("<|image_pad|>")) == 1
    counted = await counter.count_chat(one)
    # The rendered prompt, its one pad token replaced by the image's 391 tokens (vLLM's
    # processor expands it so).
    assert counted.count == len(ids) - 1 + 391 > text_only + 391
    assert counted.ids() is None  # vLLM keys media prompts' blocks by the media's hashes too
    two = chat(
        IMAGE, VIDEO, media=(MediaCount("image", 100), MediaCount("video", 900, "worst_case"))
    )
    rendered = vl_tokenizer.render_chat(two, placeholders=QWEN.placeholders)
    both = len(vl_tokenizer.encode(rendered, add_special_tokens=False))
    assert (await counter.count_chat(two)).count == both - 2 + 100 + 900


async def test_without_a_pad_token_the_items_count_on_top(vl_tokenizer: HfTokenizer) -> None:
    # A family whose placeholder has no pad token in this tokenizer: its tokens are added to
    # the rendered text (an over-count by the placeholder's own tokens: the safe side).
    counter = HfCounter(vl_tokenizer, name="hf:vl", media=FAMILIES["llava"].template)
    text_only = (await counter.count_chat(chat())).count
    counted = await counter.count_chat(chat(IMAGE, media=(MediaCount("image", 576),)))
    assert counted.count > text_only + 576


@pytest.mark.parametrize("spec", ["tiktoken:cl100k_base", "estimate"])
async def test_template_less_counters_add_the_media_tokens(spec: str) -> None:
    counter = make_counter(spec, model="m")
    text_only = (await counter.count_chat(chat())).count
    counted = await counter.count_chat(chat(IMAGE, media=(MediaCount("image", 1000),)))
    assert counted.count == text_only + 1000


async def test_tools_and_documents_count_in_every_counter(tmp_path: Path) -> None:
    tools = (
        {
            "type": "function",
            "function": {"name": "f", "description": "d" * 400, "parameters": None},
        },
    )
    plain = ChatInput([{"role": "user", "content": "hi"}])
    with_tools = ChatInput(plain.messages, tools=tools)
    with_docs = ChatInput(plain.messages, template_kwargs={"documents": [{"text": "x" * 400}]})
    for spec in ("hf:@tiny", "tiktoken:cl100k_base", "estimate"):
        counter = make_counter(spec, model="m")
        base = (await counter.count_chat(plain)).count
        assert (await counter.count_chat(with_tools)).count > base + 50, spec
        assert (await counter.count_chat(with_docs)).count > base + 50, spec
    json.dumps(tools)  # the dumped form is plain JSON
