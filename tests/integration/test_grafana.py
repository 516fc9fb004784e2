"""The Grafana dashboard (deploy/grafana/dashboards/) and the alert queries in
docs/operations.md, checked against what is really exported: every PromQL expression is
well formed and names only metrics that a live gateway's `/metrics` shows or that the real
vLLM capture (tests/fixtures/vllm/) has — and the vLLM ones also the simulator the compose
file runs as its engines. A renamed metric fails here. With Debian's `promtool` installed
(.ci/run installs it) every expression also goes through Prometheus's own parser."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.admin import ADMIN_HEADERS
from tests.integration.conftest import gateway_over
from tests.integration.test_tenants import ENGINE, call, tenant

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
VLLM_CAPTURES = sorted((ROOT / "tests" / "fixtures" / "vllm").glob("metrics-*.txt"))

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "untyped": ("",),
}
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}  # fmt: skip
FUNCTIONS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "rate", "irate", "increase", "delta", "deriv", "histogram_quantile",
    "abs", "clamp_min", "clamp_max", "max_over_time", "min_over_time", "avg_over_time",
    "time", "vector", "scalar", "round", "absent", "label_replace", "changes", "resets",
}  # fmt: skip


def exported(page: str) -> set[str]:
    """Every sample name a Prometheus page can show: from its `# TYPE` lines (so a labelled
    metric with no series yet counts) and from its samples."""
    names = set()
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            base = family.removesuffix("_total") if kind == "counter" else family
            names.update(base + suffix for suffix in SUFFIXES[kind])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (what is not a function, keyword,
    label, number or duration)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\{[^}]*\}", "", text)  # matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, after = m.group(0), text[m.end() :].lstrip()[:1]
        if word in KEYWORDS or (after == "(" and word in FUNCTIONS):
            continue
        assert after != "(", f"unknown function {word!r} in {expr!r}"
        names.add(word)
    return names


def well_formed(expr: str) -> None:
    depth = {"(": 0, "[": 0, "{": 0}
    closing = {")": "(", "]": "[", "}": "{"}
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            assert depth[closing[ch]] >= 0, expr
    assert not any(depth.values()), expr


def dashboard_exprs() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']}", target["expr"]))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    """The queries in docs/operations.md's "Metrics worth an alert" table."""
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text.split("## Metrics worth an alert", 1)[1].split("\n## ", 1)[0]
    out = []
    for row in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        if len(cells) < 2 or cells[0] in ("what", "---"):
            continue
        for expr in re.findall(r"`([^`]+)`", cells[1]):
            out.append((f"operations.md: {cells[0]}", expr.replace("\\|", "|")))
    return out


EXPRESSIONS = dashboard_exprs() + alert_exprs()


def test_the_dashboard_is_grafana_json_on_the_provisioned_data_source():
    assert DASHBOARDS
    sources = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"]
    uids = {s["uid"] for s in sources}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] in uids, panel["title"]
            assert panel["targets"], panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    assert len(dashboard_exprs()) >= 15
    assert len(alert_exprs()) >= 7


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS)
def test_every_expression_is_well_formed(where, expr):
    well_formed(expr)
    assert metric_names(expr), f"{where}: {expr!r} selects no metric"


async def test_every_expression_names_a_metric_that_is_exported():
    # Tenants, a refusal and a completed request: the labelled series exist then too.
    async with (
        gateway_over([ENGINE], tenants=[tenant("a", rpm=1)]) as gw,
        httpx.AsyncClient(timeout=30) as http,
    ):
        assert (await call(http, gw.url, "a", 3)).status_code == 200
        assert (await call(http, gw.url, "a", 3)).status_code == 429
        gateway = exported((await http.get(gw.url + "/metrics", headers=ADMIN_HEADERS)).text)
        simulator = exported((await http.get(gw.engines[0].url + "/metrics")).text)
    assert "kv_gateway_tenant_refusals_total" in gateway
    vllm = set().union(*(exported(p.read_text()) for p in VLLM_CAPTURES))
    assert "vllm:num_preemptions_total" in vllm
    for where, expr in EXPRESSIONS:
        for name in metric_names(expr):
            if name.startswith("vllm:"):
                assert name in vllm, f"{where}: {name} is not in the vLLM capture"
                assert name in simulator, f"{where}: {name} is not on the simulator's /metrics"
            else:
                assert name in gateway, f"{where}: {name} is not on the gateway's /metrics"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus)")
def test_promtool_parses_every_expression(tmp_path):
    rules = {
        "groups": [
            {
                "name": "kv-gateway",
                "rules": [
                    {"record": f"check:expr_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(EXPRESSIONS)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(EXPRESSIONS)} rules found" in result.stdout + result.stderr
