"""`kv-gateway demo` (the README's first command): it serves, and its banner says what
`/admin/status` shows, with the documented defaults."""

import re
import sys
from pathlib import Path

import httpx
import openai

from gateway.config import QueueConfig
from gateway.harness import Child, free_port


def test_the_demo_serves_and_its_banner_matches_its_status(tmp_path: Path) -> None:
    port = free_port()
    script = Path(sys.executable).with_name("kv-gateway")
    argv = [str(script), "demo", "--port", str(port)]
    demo = Child(argv, port=port, ready_path="/ready", workdir=tmp_path)
    with demo:
        client = openai.OpenAI(base_url=demo.url + "/v1", api_key="unused")
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        status = httpx.get(demo.url + "/admin/status").json()
        banner = demo.log_text()
    for engine in status["engines"]:
        line = next(line for line in banner.splitlines() if engine["url"] in line)
        usable = engine["num_gpu_blocks"] - 1
        assert re.search(
            rf"{engine['num_gpu_blocks']} KV blocks of {engine['block_size']} tokens "
            rf"\({usable} usable, {engine['capacity_blocks']} admissible",
            line,
        ), line
        assert f"{engine['max_num_seqs']} seqs" in line
    defaults = QueueConfig()
    assert f"at most {defaults.max_length} waiting" in banner
    assert f"at most {defaults.max_wait_s:g} s" in banner
