"""``python -m gateway.sim`` as a subprocess: serves, and stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway.harness import free_port
from gateway.sim import cli


def test_flags_map_onto_sim_config() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--num-gpu-blocks", "6", "--block-size", "128", "--max-model-len", "512",
         "--served-model-name", "m", "--decode-ms-per-seq", "0.5", "--no-chunked-prefill",
         "--max-num-batched-tokens", "512"]
    )  # fmt: skip
    cfg = cli.config_from_args(args)
    assert (cfg.num_gpu_blocks, cfg.block_size, cfg.max_model_len) == (6, 128, 512)
    assert cfg.served_model_name == "m" and cfg.decode_ms_per_seq == 0.5
    assert cfg.chunked_prefill is False
    assert cfg.enable_prefix_caching is True and cfg.enable_prompt_tokens_details is False
    args = parser.parse_args(["--no-enable-prefix-caching", "--enable-prompt-tokens-details"])
    cfg = cli.config_from_args(args)
    assert cfg.enable_prefix_caching is False and cfg.enable_prompt_tokens_details is True
    assert (cfg.max_num_queued_reqs, cfg.max_num_queued_tokens) == (None, None)
    args = parser.parse_args(["--max-num-queued-reqs", "0", "--max-num-queued-tokens", "4096"])
    cfg = cli.config_from_args(args)
    assert (cfg.max_num_queued_reqs, cfg.max_num_queued_tokens) == (0, 4096)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-queued-reqs", "-1"])
    assert cfg.reject_duplicate_request_ids is False
    args = parser.parse_args(["--reject-duplicate-request-ids"])
    assert cli.config_from_args(args).reject_duplicate_request_ids is True
    args = parser.parse_args(["--hide-metric", "vllm:cache_config_info", "--hide-metric", "x"])
    assert cli.config_from_args(args).hidden_metrics == ("vllm:cache_config_info", "x")
    assert cli.config_from_args(parser.parse_args([])).max_stored_responses == 4096
    args = parser.parse_args(["--max-stored-responses", "0"])
    assert cli.config_from_args(args).max_stored_responses == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-stored-responses", "-1"])


def test_an_unknown_hidden_metric_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--hide-metric", "vllm:nope"])) == 2
    assert "cannot hide vllm:nope" in capsys.readouterr().err


def test_impossible_geometry_is_refused_at_start() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--num-gpu-blocks", "4", "--max-model-len", "2048"])
    assert cli.run(args) == 2


def test_module_entry_point_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.sim", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sim did not start: {proc.stderr.read() if proc.stderr else ''!r}")
            time.sleep(0.05)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}
        )
        assert reply.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
