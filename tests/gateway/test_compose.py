"""docker-compose.yml and the Dockerfile, checked against the code (Docker itself does not
run here: no daemon). Every command the compose file gives the image must parse with the
CLI, the gateway's config must load, and every URL in it must name a compose service on the
port that service listens on."""

from pathlib import Path
from urllib.parse import urlsplit

import yaml

from gateway.cli import parse_args
from gateway.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def ours() -> dict[str, list[str]]:
    """The services built from this repository, with their commands."""
    return {name: s["command"] for name, s in SERVICES.items() if s.get("build") == "."}


def test_every_command_parses():
    commands = ours()
    assert {c[0] for c in commands.values()} == {"sim", "serve"}
    for name, command in commands.items():
        args = parse_args(command)
        assert args.command == command[0], name


def test_the_gateways_config_names_the_compose_services():
    engines_ports = {
        name: parse_args(command).port for name, command in ours().items() if command[0] == "sim"
    }
    gateways = [c for c in ours().values() if c[0] == "serve"]
    assert len(gateways) == 2  # replicas sharing Redis
    for command in gateways:
        path = Path(parse_args(command).config)
        assert path.parts[:3] == ("/", "app", "config")  # where the Dockerfile copies config/
        cfg = load_config(ROOT / "config" / path.name)
        for engine in cfg.engines:
            url = urlsplit(engine.url)
            assert engine_port(url) == engines_ports[url.hostname]
            sim = parse_args(ours()[url.hostname])
            assert engine.max_num_seqs == sim.max_num_seqs  # vLLM does not expose it
        assert cfg.redis is not None
        assert urlsplit(cfg.redis.url).hostname in SERVICES


def engine_port(url) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def test_the_dockerfile_copies_what_exists():
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
