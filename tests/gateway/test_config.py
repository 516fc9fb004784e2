from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config, parse_config

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
