"""docker-compose.yml and the Dockerfile, checked against the code (Docker itself does not
run here: no daemon). Every command the compose file gives the image must parse with the
CLI, the gateway's config must load, and every URL in it must name a compose service on the
port that service listens on. Prometheus must scrape every gateway replica (with the admin
key the gateways' config accepts) and every engine; Grafana must be provisioned with the
Prometheus service and the dashboards' directory. With Debian's `docker-compose` and
`promtool` installed (.ci/run installs them), they validate the files too."""

import hashlib
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
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


def mounts(service: str) -> dict[str, Path]:
    """A service's bind mounts: container path → the file or directory in the repository."""
    out = {}
    for volume in SERVICES[service]["volumes"]:
        host, container = volume.split(":")[:2]
        assert host.startswith("./"), volume
        assert (ROOT / host).exists(), volume
        out[container] = ROOT / host
    return out


def test_prometheus_scrapes_every_replica_and_engine_with_the_admin_key():
    files = mounts("prometheus")
    command = SERVICES["prometheus"]["command"]
    config_path = next(c.split("=", 1)[1] for c in command if c.startswith("--config.file="))
    prometheus = yaml.safe_load(files[config_path].read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    targets = {
        name: {t for group in job["static_configs"] for t in group["targets"]}
        for name, job in jobs.items()
    }
    commands = ours()
    gateways = {n for n, c in commands.items() if c[0] == "serve"}
    engines = {n for n, c in commands.items() if c[0] == "sim"}
    assert targets["kv-gateway"] == {f"{n}:{parse_args(commands[n]).port}" for n in gateways}
    assert targets["vllm"] == {f"{n}:{parse_args(commands[n]).port}" for n in engines}
    # The gateways' config has tenants, so /metrics needs an admin key: the one mounted.
    auth = jobs["kv-gateway"]["authorization"]
    assert auth["type"] == "Bearer"
    key = files[auth["credentials_file"]].read_text().strip()
    cfg = load_config(ROOT / "config" / "compose.yaml")
    assert cfg.tenants
    assert hashlib.sha256(key.encode()).hexdigest() in cfg.admin.api_keys


def test_grafana_is_provisioned_with_prometheus_and_the_dashboards():
    files = mounts("grafana")
    provisioning = files["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    url = urlsplit(sources["datasources"][0]["url"])
    assert url.hostname == "prometheus" and "prometheus" in SERVICES
    assert str(url.port) in {p.split(":")[-1] for p in SERVICES["prometheus"]["ports"]}
    providers = yaml.safe_load((provisioning / "dashboards" / "kv-gateway.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    assert list(files[path].glob("*.json")), "no dashboard where the provider reads them"
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (files[path] / Path(home).name).exists()


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Debian)")
def test_docker_compose_validates_the_file():
    result = subprocess.run(
        ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus)")
def test_promtool_validates_the_prometheus_config():
    result = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", "prometheus.yml"],
        cwd=ROOT / "deploy" / "prometheus",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
