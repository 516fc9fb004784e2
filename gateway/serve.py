"""`kv-gateway serve --config FILE`: run the gateway in front of the configured engines."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.embedded import EmbeddedServer
from gateway.engines.discovery import DiscoveryError
from gateway.engines.sharing import SharedPool
from gateway.http.app import create_app
from gateway.http.listener import protocol_for
from gateway.logformat import ACCESS_LOGGER, JsonLines, LogFormat
from gateway.runtime import Runtime, build_runtime
from gateway.workers import RUN_DIR_ENV, WorkersRefused, check, supervise, worker_place

log = logging.getLogger("gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML configuration file")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text lines, or one JSON object per line with an access line per request "
        "(request id, tenant, model, engine, blocks, outcome, timings); see docs/operations.md",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before they are cut",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes on this port, sharing their state in Redis (redis: required "
        "for more than 1); see docs/operations.md",
    )


# Libraries that log a line per HTTP call at info: the engine probes alone would write two
# lines per engine per second. Shown at debug only.
CHATTY_LIBRARIES = ("httpx", "httpcore")


def configure_logging(level: str, worker: int | None = None, fmt: LogFormat = "text") -> None:
    who = "" if worker is None else f"[worker {worker}] "
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLines(worker))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler])
    quiet = level.lower() != "debug"
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)
    # The access log: on in json; in text only at debug.
    access_on = fmt == "json" or not quiet
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.NOTSET if access_on else logging.WARNING)


async def serve(
    cfg: GatewayConfig,
    host: str,
    port: int,
    log_level: str,
    drain_s: float = 30.0,
    config_path: str | None = None,
    log_format: LogFormat = "text",
) -> None:
    """Discover the engines, then serve until SIGINT/SIGTERM (uvicorn drains in-flight
    requests). SIGHUP reads `config_path` again and applies its `tenants:`. As one of
    `serve --workers N` (gateway/workers.py) it serves on the supervisor's socket and
    shares one engine monitor with the other workers."""
    place = worker_place()
    shared = None
    if place is not None:
        shared = SharedPool(Path(os.environ[RUN_DIR_ENV]), lead=place[0] == 0)
    runtime = await build_runtime(cfg, shared)
    app = create_app(runtime, None if place is None else (place[0], place[1]))
    _check_file_limit(cfg)
    server = EmbeddedServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=max(1, round(drain_s)),
            http=protocol_for(cfg.clients, runtime.metrics),
            # json: uvicorn's own lines through the root handler (JSON too); its access log
            # gives way to the gateway's.
            log_config=None if log_format == "json" else LOGGING_CONFIG,
            access_log=log_format != "json",
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop, server)
    if config_path is not None:
        loop.add_signal_handler(signal.SIGHUP, _reload, config_path, runtime)
    if place is None:
        log.info("kv-gateway listening on http://%s:%d", host, port)
        await server.serve()
    else:
        await server.serve(sockets=[socket.socket(fileno=place[2])])


def _check_file_limit(cfg: GatewayConfig) -> None:
    """Client connections, pooled engine connections and a margin must fit the process's
    file descriptors, or accept() fails before the connection cap can answer 503."""
    needed = cfg.clients.max_connections + cfg.upstream.max_connections + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "open files limited to %d, below clients.max_connections + "
            "upstream.max_connections + 64 = %d: raise `ulimit -n` or lower them",
            soft,
            needed,
        )


def _reload(config_path: str, runtime: Runtime) -> None:
    """SIGHUP: the tenants (API keys and limits), the admin keys and the service classes
    from the config file, without a restart. A file that does not validate changes nothing."""
    try:
        new = load_config(config_path)
    except ConfigError as e:
        log.error("reload of %s refused, nothing changed: %s", config_path, e)
        return
    others = runtime.reload_keys(new)
    log.warning(
        "reloaded tenants and admin keys from %s: %d tenant(s), %d admin key(s), "
        "%d service class(es)",
        config_path,
        len(new.tenants),
        len(new.admin.api_keys),
        len(new.slo.classes),
    )
    if others:
        log.warning("changed sections need a restart and were not applied: %s", others)


def _stop(server: uvicorn.Server) -> None:
    """First signal: drain and stop; a second one: stop now."""
    if server.should_exit:
        server.force_exit = True
    server.should_exit = True


def run(args: argparse.Namespace) -> int:
    place = worker_place()
    configure_logging(args.log_level, None if place is None else place[0], args.log_format)
    try:
        cfg = load_config(args.config)
        check(cfg, args.workers)
        if args.workers > 1 and place is None:
            return supervise(args)
        asyncio.run(
            serve(
                cfg,
                args.host,
                args.port,
                args.log_level,
                args.drain_s,
                args.config,
                args.log_format,
            )
        )
    except (ConfigError, WorkersRefused) as e:
        print(f"kv-gateway: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the port is taken, or the address cannot be bound
        print(f"kv-gateway: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    except DiscoveryError as e:
        print(f"kv-gateway: engine discovery failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
