"""`kv-gateway serve --config FILE`: run the gateway in front of the configured engines."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import resource
import signal
import sys

import uvicorn

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.embedded import EmbeddedServer
from gateway.engines.discovery import DiscoveryError
from gateway.http.app import create_app
from gateway.http.listener import protocol_for
from gateway.runtime import Runtime, build_runtime

log = logging.getLogger("gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML configuration file")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may finish before they are cut",
    )


# Libraries that log a line per HTTP call at info: the engine probes alone would write two
# lines per engine per second. Shown at debug only.
CHATTY_LIBRARIES = ("httpx", "httpcore")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    quiet = level.lower() != "debug"
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)


async def serve(
    cfg: GatewayConfig,
    host: str,
    port: int,
    log_level: str,
    drain_s: float = 30.0,
    config_path: str | None = None,
) -> None:
    """Discover the engines, then serve until SIGINT/SIGTERM (uvicorn drains in-flight
    requests). SIGHUP reads `config_path` again and applies its `tenants:`."""
    runtime = await build_runtime(cfg)
    app = create_app(runtime)
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
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop, server)
    if config_path is not None:
        loop.add_signal_handler(signal.SIGHUP, _reload, config_path, runtime)
    log.info("kv-gateway listening on http://%s:%d", host, port)
    await server.serve()


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
    """SIGHUP: the tenants (API keys and limits) and the admin keys from the config file,
    without a restart. A file that does not validate changes nothing."""
    try:
        new = load_config(config_path)
    except ConfigError as e:
        log.error("reload of %s refused, nothing changed: %s", config_path, e)
        return
    others = runtime.reload_keys(new)
    log.warning(
        "reloaded tenants and admin keys from %s: %d tenant(s), %d admin key(s)",
        config_path,
        len(new.tenants),
        len(new.admin.api_keys),
    )
    if others:
        log.warning("changed sections need a restart and were not applied: %s", others)


def _stop(server: uvicorn.Server) -> None:
    """First signal: drain and stop; a second one: stop now."""
    if server.should_exit:
        server.force_exit = True
    server.should_exit = True


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        cfg = load_config(args.config)
        asyncio.run(serve(cfg, args.host, args.port, args.log_level, args.drain_s, args.config))
    except ConfigError as e:
        print(f"kv-gateway: {e}", file=sys.stderr)
        return 2
    except DiscoveryError as e:
        print(f"kv-gateway: engine discovery failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
