from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config
from gateway.core.latency import StepCosts
from gateway.core.types import ServiceClass

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_is_valid():
    cfg = load_config(ROOT / "config" / "example.yaml")
    assert [e.display_name for e in cfg.engines] == ["big", "small"]
    assert cfg.tokenizer_for("tiny") == "hf:@tiny"
    assert cfg.tokenizer_for("other") == "engine"
    assert cfg.admission.kv_ceiling == 0.95


def test_url_only_engine_is_enough():
    cfg = parse_config({"engines": [{"url": "http://127.0.0.1:9/"}]})
    assert cfg.engines[0].url == "http://127.0.0.1:9"
    assert cfg.engines[0].display_name == "127.0.0.1:9"


def test_kv_events_is_off_by_default_and_takes_a_publisher_to_connect_to():
    cfg = parse_config(
        {"engines": [{"url": "http://a"}, {"url": "http://b", "kv_events": "tcp://b:5557"}]}
    )
    assert [e.kv_events for e in cfg.engines] == [None, "tcp://b:5557"]


KEY = "a" * 64
SLO_ERRORS = [
    ({"slo": {"classes": {"i": {"ttft_s": 0}}}}, "slo.classes.i.ttft_s"),
    ({"slo": {"classes": {"i": {"tpot_s": -0.1}}}}, "slo.classes.i.tpot_s"),
    ({"slo": {"classes": {"i": {"ttft_s": float("inf")}}}}, "slo.classes.i.ttft_s"),
    ({"slo": {"classes": {"i": {"ttft": 1}}}}, "slo.classes.i.ttft: unknown key"),
    ({"slo": {"classes": {"a b": {}}}}, "slo.classes"),
    ({"slo": {"classes": {"": {}}}}, "slo.classes"),
    ({"slo": {"classes": {"i": {}}, "default_class": "j"}}, "slo.default_class 'j'"),
    ({"slo": {"header": "has space"}}, "slo.header"),
    ({"slo": {"header": "Authorization"}}, "slo.header"),
    ({"slo": {"step_costs": {"base_ms": -1}}}, "slo.step_costs.base_ms"),
    ({"slo": {"step_costs": {"per_prefill_token_ms": float("nan")}}}, "slo.step_costs"),
    ({"slo": {"step_costs": {"chunk_tokens": 0}}}, "slo.step_costs.chunk_tokens"),
    ({"slo": {"calibrate": "sometimes"}}, "slo.calibrate"),
    ({"slo": {"targets": {}}}, "slo.targets: unknown key"),
    (
        {"engines": [{"url": "http://a", "step_costs": {"per_seq_ms": -2}}]},
        "engines.0.step_costs.per_seq_ms",
    ),
    (
        {"tenants": [{"name": "t", "api_keys": [KEY], "service_class": "gold"}]},
        "tenants.0.service_class: 'gold' is not in slo.classes",
    ),
    (
        {
            "slo": {"classes": {"gold": {"ttft_s": 1}}},
            "tenants": [{"name": "t", "api_keys": [KEY], "service_classes": ["gold", "tin"]}],
        },
        "tenants.0.service_classes.1: 'tin' is not in slo.classes",
    ),
]


def test_service_classes_and_step_costs():
    cfg = parse_config(
        {
            "engines": [
                {
                    "url": "http://a",
                    "name": "a",
                    "step_costs": {"base_ms": 4, "chunk_tokens": 8192},
                },
                {"url": "http://b", "name": "b"},
            ],
            "slo": {
                "classes": {"interactive": {"ttft_s": 1, "tpot_s": 0.05}, "batch": {}},
                "default_class": "batch",
                "header": "X-Service-Class",
                "step_costs": {"per_seq_ms": 0.2, "overhead_ms": 0},
            },
            "tenants": [
                {"name": "t", "api_keys": [KEY], "service_class": "interactive"},
            ],
        }
    )
    assert cfg.slo.header == "x-service-class"  # as ASGI hands header names over
    assert cfg.slo.service_class("interactive") == ServiceClass("interactive", 1.0, 0.05)
    assert not cfg.slo.service_class("batch").has_targets
    assert cfg.tenants[0].service_class == "interactive"
    # Engine a's own costs over slo.step_costs, in seconds; b (and an engine the file does
    # not name) has slo.step_costs alone, the rest at their defaults.
    assert cfg.step_costs_for("a") == StepCosts(0.004, 0.0002, 0.00005, 8192, 0.0)
    assert cfg.step_costs_for("b") == StepCosts(0.01, 0.0002, 0.00005, 2048, 0.0)
    assert cfg.step_costs_for("from-dns") == cfg.step_costs_for("b")


def test_no_slo_section_means_no_classes_and_the_default_costs():
    cfg = parse_config({"engines": [{"url": "http://a"}]})
    assert cfg.slo.classes == {} and cfg.slo.default_class is None
    assert cfg.slo.header == "x-kv-gateway-service-class" and cfg.slo.calibrate
    # The simulator's step model with vLLM's default step budget on most GPUs.
    assert cfg.step_costs_for("a") == StepCosts(0.01, 0.0005, 0.00005, 2048, 0.005)


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"engines": [{"url": "http://a", "bogus": 1}]}, "engines.0.bogus: unknown key"),
        ({"engines": [{"url": "http://a", "num_gpu_blocks": 0}]}, "engines.0.num_gpu_blocks"),
        ({"engines": [{"url": "ftp://a"}]}, "engines.0.url"),
        ({"engines": []}, "engines"),
        (
            {"engines": [{"url": "http://a"}], "admission": {"kv_ceiling": 1.5}},
            "admission.kv_ceiling",
        ),
        ({"engines": [{"url": "http://a"}], "queue": {"max_wait_s": 0}}, "queue.max_wait_s"),
        (
            {"engines": [{"url": "http://a"}], "models": [{"name": "m", "tokenizer": "x"}]},
            "models.0.tokenizer",
        ),
        ({"engines": [{"url": "http://a"}], "routing": {"scorers": ["nope"]}}, "routing.scorers"),
        (
            {"engines": [{"url": "http://a"}], "admission": {"reservation": "hopeful"}},
            "admission.reservation",
        ),
        (
            {
                "engines": [{"url": "http://a"}],
                "admission": {"prediction": {"window": 10, "min_samples": 20}},
            },
            "admission.prediction",
        ),
        (
            {"engines": [{"url": "http://a"}], "admission": {"prediction": {"quantile": 0}}},
            "admission.prediction.quantile",
        ),
        ({"engines": [{"url": "http://a"}, {"url": "http://a"}]}, "unique"),
        ({"engines": [{"url": "http://a"}], "extra_top": 1}, "extra_top: unknown key"),
        ({"engines": [{"url": "http://a", "kv_events": "tcp://*:5557"}]}, "engines.0.kv_events"),
        ({"engines": [{"url": "http://a", "kv_events": "http://a:1"}]}, "engines.0.kv_events"),
        ({"engines": [{"url": "http://a", "kv_events": "tcp://a"}]}, "engines.0.kv_events"),
        (
            {
                "engines": [{"url": "http://a", "kv_events": "tcp://a:5557"}],
                "prefix_cache": {"index_entries": 0},
            },
            "prefix_cache.index_entries > 0",
        ),
        (
            {"engines": [{"url": "http://a"}], "clients": {"max_header_bytes": 100 * 1024}},
            "clients.max_header_bytes cannot exceed clients.max_head_bytes",
        ),
        (
            {"engines": [{"url": "http://a"}], "clients": {"max_head_bytes": 100}},
            "clients.max_head_bytes",
        ),
        *(({"engines": [{"url": "http://a"}], **section}, names) for section, names in SLO_ERRORS),
    ],
)
def test_bad_config_names_the_key(data, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        parse_config(data)


def test_unreadable_and_non_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
