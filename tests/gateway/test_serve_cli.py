"""`kv-gateway serve` as a user runs it: a subprocess, a config file, signals."""

import asyncio
import signal
import subprocess
import sys
import textwrap

import httpx

from gateway.harness import SimProcess, free_port


async def test_serve_subprocess_answers_and_stops_on_sigterm(tmp_path):
    sim = await SimProcess(num_gpu_blocks=65, max_model_len=512).astart()
    try:
        port = free_port()
        config = tmp_path / "gw.yaml"
        config.write_text(
            textwrap.dedent(f"""
            engines:
              - url: {sim.url}
                max_num_seqs: 8
            models:
              - name: tiny
                tokenizer: hf:@tiny
        """)
        )
        proc = subprocess.Popen(  # noqa: ASYNC220
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--config",
                str(config),
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            async with httpx.AsyncClient() as http:
                for _ in range(200):
                    try:
                        if (await http.get(f"http://127.0.0.1:{port}/ready")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        await asyncio.sleep(0.05)
                r = await http.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
                )
                assert r.status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            out = proc.stdout.read().decode() if proc.stdout else ""
            proc.stdout.close()
        assert "num_gpu_blocks = 65 (discovered:/metrics)" in out
        assert "Traceback" not in out
    finally:
        sim.stop()


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("engines:\n  - url: http://127.0.0.1:9\n    num_gpu_blocks: -3\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "engines.0.num_gpu_blocks" in result.stderr and "Traceback" not in result.stderr


def test_unreachable_engine_is_a_clear_startup_error(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text(f"engines:\n  - url: http://127.0.0.1:{free_port()}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "engine discovery failed" in result.stderr and "Traceback" not in result.stderr


async def test_a_missing_tokenizer_directory_is_one_line_and_exit_2(tmp_path):
    sim = await SimProcess(num_gpu_blocks=65, max_model_len=512).astart()
    try:
        config = tmp_path / "gw.yaml"
        missing = tmp_path / "no-such-tokenizer"
        config.write_text(
            f"engines:\n  - url: {sim.url}\n    max_num_seqs: 8\n"
            f"models:\n  - name: tiny\n    tokenizer: hf:{missing}\n"
        )
        result = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        sim.stop()
    assert result.returncode == 2
    assert "models:" in result.stderr and "is not a directory" in result.stderr
    assert "Traceback" not in result.stderr and "Unclosed" not in result.stderr
