"""`kv-gateway loadtest sweep` against the real engine: three KV cache sizes
(`--kv-cache-memory-bytes`, CPU's stand-in for gpu_memory_utilization), vLLM restarted for each
by the spec's command template, the same load direct at each. A freshly started engine is slow
on its first requests (TTFT ~0.5 s), so the first wave is warm-up, left out of the figures.

Named to run first in the package: the package's shared engine (`vllm_url`) starts only when a
later test asks for it, so two engines never share the 2 cores.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from tests.e2e import conftest

pytestmark = pytest.mark.vllm

BYTES_PER_BLOCK = conftest.BLOCK_SIZE * 1024  # fp32 tiny model: 1,024 B per token
BLOCKS = [32, 12, 6]  # large to small: TTFT and preemptions should grow as the cache shrinks
# A connection the engine closed before any answer: with a FIN (ServerDisconnectedError) or,
# when the request was still unread in its buffer, a reset (ClientOSError).
DROPPED = {"error:0:ServerDisconnectedError", "error:0:ClientOSError"}


def test_sweep_kv_cache_bytes_on_the_real_engine(
    vllm_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = [
        str(conftest.VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(vllm_model_dir), "--served-model-name", "tiny",
        "--max-model-len", str(conftest.MAX_MODEL_LEN),
        "--max-num-seqs", str(conftest.MAX_NUM_SEQS),
        "--dtype", "float32", "--enforce-eager",
        "--host", "127.0.0.1", "--port", "{port}",
    ]  # fmt: skip
    spec = {
        "parameter": "kv_cache_memory_bytes",
        "values": [n * BYTES_PER_BLOCK for n in BLOCKS],
        "command": shlex.join(command) + " --kv-cache-memory-bytes {value}",
        "url": "http://127.0.0.1:{port}",
        "env": {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
            "VLLM_CPU_KVCACHE_SPACE": None,  # else it decides the KV size
            # The engine's threads on one core: the API server that streams the tokens and this
            # client keep the other (with both cores it starves them, and tokens come in bursts).
            "VLLM_CPU_OMP_THREADS_BIND": "0",
        },
        "startup_timeout_s": 240,
        "planner": {
            "model": str(vllm_model_dir / "config.json"),
            "gpu-memory-gib": 24,
            "dtype": "float32",
            "block-size": conftest.BLOCK_SIZE,
            "max-model-len": conftest.MAX_MODEL_LEN,
        },
        "through": "direct",
    }
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(json.dumps(spec))
    out = tmp_path / "sweep.json"
    code = main(
        [
            "loadtest", "sweep", "--spec", str(spec_path),
            "--tokenizer", f"hf:{vllm_model_dir}", "--api", "completions",
            "--concurrency", str(conftest.MAX_NUM_SEQS), "--requests", "48", "--warmup", "8",
            "--input-len", "100", "--output-len", "150", "--scrape-interval", "0.25",
            "--timeout", "300", "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    printed = capsys.readouterr()
    sys.stdout.write(printed.out)
    if code != 0 and "did not start" in printed.out + printed.err:
        conftest.explain_failure(f"the sweep's engine did not start:\n{printed.out}{printed.err}")
    assert code == 0, printed.err
    assert "kv_cache_memory_bytes" in printed.out and "recommendation" in printed.out
    rows = json.loads(out.read_text())["rows"]
    assert not any(r.get("skipped") for r in rows), rows
    for row, blocks in zip(rows, BLOCKS, strict=True):
        # The planner's prediction for the byte budget is what the engine reports.
        assert row["planned_blocks"] == row["reported_blocks"] == blocks
        # Every request answered, but for this: on a busy 2-core machine vLLM's API server now
        # and then closes a kept-alive connection without reading its request (two CI runs
        # and a run by hand each lost 1-2 of 40 before any byte, as ServerDisconnectedError or
        # ClientOSError; vLLM's access log had 46 of the 48 requests, and its /metrics did not
        # answer for 11 s around them). That is the engine's, going direct; anything else, or
        # more of it, fails the test.
        failures = row["failures"]
        assert set(failures) <= DROPPED and sum(failures.values()) <= 3, failures
    large, middle, small = rows
    # 8 requests growing to 250 tokens (2 blocks each) fit in 31 usable blocks; in 11 five
    # run at once, in 5 two: preemptions, and requests waiting for their first token.
    # From none to some as the cache shrinks. Between 12 and 6 blocks the count does not
    # order: fewer requests run at once in 6, so fewer are there to be preempted (seen 26 in
    # 12 blocks against 23 in 6 in one CI run, 20 against 37 in another).
    assert large["preemptions"] == 0 < middle["preemptions"]
    assert small["preemptions"] > 0
    # In 5 blocks two requests run at a time where 32 hold all eight: a request's whole time
    # grows. (Not TTFT: vLLM prefills a waiting prompt as soon as one block is free and preempts
    # later, so a small cache can give a first token as soon as a large one; seen 1.5 s vs
    # 1.2 s.) Medians: one stall of the engine on a busy 2-core machine moves a mean.
    assert large["e2e_p50_ms"] < small["e2e_p50_ms"]
    dropped = sum(n for r in rows for code, n in r["failures"].items() if code in DROPPED)
    if dropped:
        conftest.record_figure("loadtest sweep: connections vLLM dropped", str(dropped))
    conftest.record_figure(
        "loadtest sweep (blocks: preemptions, TTFT p50 / mean ms, E2E p50 ms)",
        ", ".join(
            f"{b}: {r['preemptions']}, {r['ttft_p50_ms']:.0f} / {r['ttft_mean_ms']:.0f}, "
            f"{r['e2e_p50_ms']:.0f}"
            for b, r in zip(BLOCKS, rows, strict=True)
        ),
    )
