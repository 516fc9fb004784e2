"""`kv-gateway plan` through the real dispatcher: table, --json, --emit-config, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from tests.planner import TINY_CONFIG


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        *("--model", "llama-3.1-8b", "--gpu", "rtx4090", "--max-model-len", "8192"),
        *("--prompt-mean", "800", "--output-mean", "200"),
    )
    assert code == 0
    assert "bytes per token" in out and "131,072" in out
    assert "overhead (estimate)" in out and "ESTIMATE" in out
    assert "max concurrency @ 1,000" in out
    assert "queue.max_wait_s" in out


def test_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys,
        *("--model", "deepseek-v3", "--gpu", "h200", "-tp", "8", "--block-size", "64"),
        *("--max-model-len", "32768", "--target-concurrency", "32", "--json"),
    )
    assert code == 0
    data = json.loads(out)
    assert data["kv"]["bytes_per_token"] == 70_272
    assert data["memory_gib"]["overhead"]["is_estimate"] is True
    assert data["startup"]["ok"] is True
    assert data["inverse"]["concurrency"] == 32
    gateway = data["recommendation"]["gateway"]
    assert set(gateway) == {"admission", "queue"}
    assert set(gateway["queue"]) == {"max_length", "max_wait_s"}


@pytest.mark.parametrize(("budget", "blocks"), [("786432", 6), ("1572864", 12), ("4194304", 32)])
def test_emit_config_for_the_real_engine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, budget: str, blocks: int
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    code, out, _ = run(
        capsys,
        *("--model", str(tmp_path / "config.json"), "--dtype", "float32"),
        *("--block-size", "128", "--max-model-len", "512", "--max-num-seqs", "8"),
        *("--kv-cache-memory-bytes", budget, "--gpu-memory-gib", "24", "--emit-config"),
        *("--url", "http://10.0.0.1:8000", "--url", "http://10.0.0.2:8000", "--name", "tiny"),
    )
    assert code == 0
    engines = yaml.safe_load(out)["engines"]
    assert [e["name"] for e in engines] == ["tiny-0", "tiny-1"]
    for engine in engines:
        assert list(engine) == [
            "name",
            "url",
            "num_gpu_blocks",
            "block_size",
            "max_num_seqs",
            "max_model_len",
        ]
        assert engine["num_gpu_blocks"] == blocks
        assert (engine["block_size"], engine["max_num_seqs"], engine["max_model_len"]) == (
            128,
            8,
            512,
        )


def test_emit_config_default_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "qwen2.5-7b", "--gpu", "l4", "--emit-config")
    assert code == 0
    (engine,) = yaml.safe_load(out)["engines"]
    assert engine["url"] == "http://127.0.0.1:8001"
    assert engine["name"] == "qwen2-5-7b"


def test_emit_config_refuses_an_engine_that_would_not_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "--model", "qwen2.5-72b", "--gpu", "l4", "--emit-config")
    assert code == 1 and out == ""
    assert "would not start" in err and "fix:" in err


def test_trace(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "\n".join(json.dumps({"prompt_tokens": p, "output_tokens": 100}) for p in range(100, 120))
    )
    code, out, _ = run(
        capsys,
        "--model",
        "qwen3-8b",
        "--gpu",
        "a10",
        "--max-model-len",
        "8192",
        "--trace",
        str(trace),
        "--json",
    )
    assert code == 0
    assert json.loads(out)["workload"]["requests"] == 20


def test_list_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--list-presets")
    assert code == 0 and "deepseek-v3" in out and "h200" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "h100"], "--model is required"),
        (["--model", "gpt-9", "--gpu", "h100"], "unknown model preset"),
        (["--model", "qwen3-8b", "--gpu", "tpu"], "unknown GPU preset"),
        (["--model", "qwen3-8b"], "give --gpu"),
        (["--model", "qwen3-8b", "--gpu", "h100", "--gpu-memory-utilization", "1.2"], "(0, 1]"),
        (["--model", "/no/such/config.json", "--gpu", "h100"], "no such file"),
        (["--model", "qwen3-8b", "--gpu", "h100", "--prompt-mean", "5"], "--output-mean"),
        (["--model", "qwen3-8b", "--gpu", "h100", "--trace", "/no/trace"], "cannot read trace"),
        (["--model", "qwen3-8b", "--gpu", "h100", "--kv-cache-dtype", "int3"], "unknown dtype"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_config_file_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{broken")
    code, _, err = run(capsys, "--model", str(bad), "--gpu", "h100")
    assert code == 2 and "is not JSON" in err
