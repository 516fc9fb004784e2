"""The media counter: sizes read from headers, the limits, the worst cases, the refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.media import FAMILIES, MediaCounter, MediaPolicy
from gateway.media.images import image_size
from gateway.media.sources import FetchPolicy
from gateway.tokens.errors import InvalidChatRequest
from tests.media.images import data_url, image_bytes, image_part

QWEN = MediaPolicy(family=FAMILIES["qwen2_vl"])


def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_size_from_the_header(fmt: str) -> None:
    assert image_size(image_bytes(640, 480, fmt)) == (640, 480)


def test_exif_rotation_swaps_the_sides_as_vllm_does() -> None:
    assert image_size(image_bytes(640, 480, "JPEG", orientation=6)) == (480, 640)
    assert image_size(image_bytes(640, 480, "JPEG", orientation=3)) == (640, 480)


async def test_data_url_images_count_by_the_family_rule() -> None:
    counter = MediaCounter("vl", QWEN)
    png = data_url(image_bytes(640, 480))
    jpeg = data_url(image_bytes(1024, 768, "JPEG"), "image/jpeg")
    counted = await counter.count(chat(image_part(png), image_part(jpeg)))
    assert [(c.modality, c.tokens, c.source) for c in counted] == [
        ("image", 391, "size"),
        ("image", 999, "size"),
    ]
    # A request's mm_processor_kwargs bound the pixels, as in vLLM.
    bounded = await counter.count(chat(image_part(png)), {"min_pixels": 256 * 784})
    assert (
        bounded[0].tokens == 391
        and (await counter.count(chat(image_part(png)), {"max_pixels": 100 * 784}))[0].tokens <= 100
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:image/png;base64," + "QUJD" * 4, "cannot read the image"),
        ("data:image/png,rawbytes", "only base64 data URLs"),
        ("data:image/png;base64", "missing ','"),
        (data_url(b"%PDF-1.4 not an image"), "cannot read the image"),
    ],
)
async def test_unreadable_image_data_is_refused(url: str, message: str) -> None:
    with pytest.raises(InvalidChatRequest, match=message) as info:
        await MediaCounter("vl", QWEN).count(chat(image_part(url)))
    assert "messages[0].content[1]" in str(info.value)


async def test_oversized_images_are_refused() -> None:
    big = data_url(image_bytes(2000, 1000))
    small_bytes = MediaPolicy(family=FAMILIES["qwen2_vl"], max_image_bytes=1000)
    with pytest.raises(InvalidChatRequest, match="larger than 1000 bytes"):
        await MediaCounter("vl", small_bytes).count(chat(image_part(big)))
    few_pixels = MediaPolicy(family=FAMILIES["qwen2_vl"], max_image_pixels=1_000_000)
    with pytest.raises(InvalidChatRequest, match=r"2000x1000 \(2000000 pixels\) exceed"):
        await MediaCounter("vl", few_pixels).count(chat(image_part(big)))
    with pytest.raises(InvalidChatRequest, match="aspect ratio"):
        await MediaCounter("vl", QWEN).count(chat(image_part(data_url(image_bytes(402, 2)))))


async def test_remote_images_count_at_the_worst_case_unless_fetched() -> None:
    url = "http://images.invalid/cat.png"  # never fetched: fetching is off
    counted = await MediaCounter("vl", QWEN).count(chat(image_part(url)))
    assert [(c.tokens, c.source) for c in counted] == [(16384, "worst_case")]
    configured = MediaPolicy(family=FAMILIES["qwen2_vl"], worst_case={"image": 5000})
    assert (await MediaCounter("vl", configured).count(chat(image_part(url))))[0].tokens == 5000


async def test_what_cannot_be_counted_is_refused_or_worst_case() -> None:
    video = {"type": "video_url", "video_url": {"url": "http://v.invalid/a.mp4"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    embeds = {"type": "image_embeds", "image_embeds": "AAAA"}
    for part, modality in [(video, "video"), (audio, "audio"), (embeds, "image")]:
        no_rule = MediaPolicy()
        with pytest.raises(InvalidChatRequest, match=f"cannot count this {modality} part"):
            await MediaCounter("vl", no_rule).count(chat(part))
        worst = MediaPolicy(worst_case={modality: 1234})
        counted = await MediaCounter("vl", worst).count(chat(part))
        assert [(c.modality, c.tokens, c.source) for c in counted] == [
            (modality, 1234, "worst_case")
        ]
    prompt_embeds = {"type": "prompt_embeds", "data": "AAAA"}
    with pytest.raises(InvalidChatRequest, match="cannot count prompt_embeds"):
        await MediaCounter("vl", MediaPolicy(worst_case={"image": 1})).count(chat(prompt_embeds))


async def test_images_without_a_family_use_the_configured_worst_case() -> None:
    png = image_part(data_url(image_bytes(64, 64)))
    with pytest.raises(InvalidChatRequest, match="cannot count images"):
        await MediaCounter("vl", MediaPolicy()).count(chat(png))
    counted = await MediaCounter("vl", MediaPolicy(worst_case={"image": 700})).count(chat(png))
    assert counted[0].tokens == 700


async def test_engine_counted_media_is_only_checked() -> None:
    # With the engine's /tokenize counting media, data URLs are still checked here.
    counter = MediaCounter("vl", MediaPolicy(), counts=False)
    ok = await counter.count(
        chat(image_part(data_url(image_bytes(64, 64))), image_part("http://x/y"))
    )
    assert [c.source for c in ok] == ["engine", "engine"]
    with pytest.raises(InvalidChatRequest, match="not valid base64"):
        await counter.count(chat(image_part("data:image/png;base64,@@@")))


# --- fetching, against a real HTTP server on loopback ----------------------------------------


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    png = image_bytes(1920, 1080)

    async def image(request: web.Request) -> web.StreamResponse:
        return web.Response(body=png, content_type="image/png")

    async def huge(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"\x89PNG" + b"\0" * 200_000, content_type="image/png")

    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(5)
        return web.Response(body=png)

    async def missing(request: web.Request) -> web.StreamResponse:
        return web.Response(status=404)

    app = web.Application()
    app.add_routes(
        [
            web.get("/a.png", image),
            web.get("/huge", huge),
            web.get("/slow", slow),
            web.get("/404", missing),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_fetched_images_count_by_size_within_limits(image_server: str) -> None:
    policy = MediaPolicy(
        family=FAMILIES["qwen2_vl"], fetch=FetchPolicy(enabled=True, max_bytes=100_000, timeout_s=1)
    )
    async with aiohttp.ClientSession() as session:
        counter = MediaCounter("vl", policy, session=lambda: session)
        counted = await counter.count(chat(image_part(f"{image_server}/a.png")))
        assert [(c.tokens, c.source) for c in counted] == [(2691, "size")]
        for path, message in [
            ("/huge", "larger than 100000 bytes"),
            ("/slow", "longer than 1 s"),
            ("/404", "HTTP 404"),
        ]:
            with pytest.raises(InvalidChatRequest, match=message):
                await counter.count(chat(image_part(f"{image_server}{path}")))
