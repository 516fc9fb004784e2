"""``kv-gateway sim``: one simulated vLLM engine on uvicorn (also ``python -m gateway.sim``)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from gateway.sim.server import SimConfig, create_app

_DEFAULTS = SimConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add("--served-model-name", default=d.served_model_name, help="model id (default %(default)s)")
    add(
        "--num-gpu-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV cache blocks, vLLM's null block included (default %(default)s)",
    )
    add(
        "--block-size",
        type=int,
        default=d.block_size,
        help="tokens per block (default %(default)s)",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="max running sequences (default %(default)s)",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step (default %(default)s)",
    )
    add(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="prompt + output limit (default %(default)s)",
    )
    add(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="schedule a prompt only when it fits whole in a step's budget",
    )
    add(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="automatic prefix caching, vLLM v1's default (--no-enable-prefix-caching: off)",
    )
    add(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag; off by default)",
    )
    add(
        "--max-num-queued-reqs",
        type=_non_negative_int,
        default=d.max_num_queued_reqs,
        help="refuse (503) a request when waiting + running sequences would exceed this "
        "(vLLM's flag; default: no limit)",
    )
    add(
        "--max-num-queued-tokens",
        type=_non_negative_int,
        default=d.max_num_queued_tokens,
        help="refuse (503) a request while the prompts not yet prefilled hold this many tokens "
        "(vLLM's flag; default: no limit)",
    )
    add(
        "--reject-duplicate-request-ids",
        action="store_true",
        help="answer 400 to a request whose x-request-id is already in flight, as vLLM "
        "0.7-0.10 did (default: accept, as current vLLM)",
    )
    add(
        "--max-stored-responses",
        type=_non_negative_int,
        default=d.max_stored_responses,
        help="Responses API responses kept for previous_response_id, least recently used "
        "forgotten first (default %(default)s; 0: none, as vLLM without "
        "VLLM_ENABLE_RESPONSES_API_STORE; vLLM with it keeps them all)",
    )
    add(
        "--hide-metric",
        dest="hidden_metrics",
        action="append",
        default=[],
        metavar="NAME",
        help="leave this metric family out of /metrics (repeatable; a testing aid to imitate "
        "another vLLM version, e.g. vllm:num_preemptions_total)",
    )
    add(
        "--prefill-ms-per-token",
        type=float,
        default=d.prefill_ms_per_token,
        help="step cost per prefilled token, ms (default %(default)s)",
    )
    add(
        "--decode-ms-base",
        type=float,
        default=d.decode_ms_base,
        help="fixed cost of a step, ms (default %(default)s)",
    )
    add(
        "--decode-ms-per-seq",
        type=float,
        default=d.decode_ms_per_seq,
        help="step cost per scheduled sequence, ms (default %(default)s)",
    )
    add("--seed", type=int, default=d.seed, help="seed of the generated text (default %(default)s)")
    add(
        "--tokenizer",
        type=Path,
        default=d.tokenizer,
        help="tokenizer directory (default: the bundled tiny tokenizer)",
    )
    add("--host", default=d.host, help="bind address (default %(default)s)")
    add("--port", type=int, default=d.port, help="port (default %(default)s)")
    add("--log-level", default="info", help="uvicorn log level (default %(default)s)")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        served_model_name=args.served_model_name,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_base=args.decode_ms_base,
        decode_ms_per_seq=args.decode_ms_per_seq,
        seed=args.seed,
        tokenizer=args.tokenizer,
        chunked_prefill=args.chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        reject_duplicate_request_ids=args.reject_duplicate_request_ids,
        max_stored_responses=args.max_stored_responses,
        hidden_metrics=tuple(args.hidden_metrics),
        host=args.host,
        port=args.port,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (uvicorn drains and runs the lifespan shutdown)."""
    cfg = config_from_args(args)
    try:
        app = create_app(cfg)
    except ValueError as exc:  # EngineError, or a flag the simulator refuses at start
        print(f"kv-gateway sim: {exc}", file=sys.stderr)
        return 2
    print(
        f"simulated vLLM engine {cfg.served_model_name!r}: {cfg.num_gpu_blocks} blocks of "
        f"{cfg.block_size} tokens, max_num_seqs {cfg.max_num_seqs}, max_model_len "
        f"{cfg.max_model_len}, prefix caching {'on' if cfg.enable_prefix_caching else 'off'} "
        f"on http://{cfg.host}:{cfg.port}",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=args.log_level, access_log=False
    )
    _GracefulServer(config).run()
    return 0


class _GracefulServer(uvicorn.Server):
    """SIGINT/SIGTERM drain and exit with status 0 (uvicorn would re-raise the signal)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _EXIT_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
