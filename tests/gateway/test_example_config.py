"""config/example.yaml against the config models (gateway/config.py): every key of
`GatewayConfig` at any depth — list items' keys (`engines[].kv_events`) and the keys of a
mapping's values (`slo.classes.<name>.ttft_s`) included — is in the example, live or
commented out, and the example names no key the models lack.

A commented-out key is a line `# key: value` (or `# - key: value`) whose `#` stands where
the key would: removing the `# ` leaves the YAML the key would be live as. Prose comments
never start with a lower-case `name:`, so they stay comments.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from gateway.config import GatewayConfig, parse_config
from tests.gateway.test_configuration_doc import _submodel

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "example.yaml"
COMMENTED_KEY = re.compile(r"^(\s*)# (\s*(?:- )?[a-z_][a-z0-9_]*:(?:\s|$))")
# `sha256:<64 hex digits from ...>`: a placeholder where a tenant's or admin's key goes.
KEY_PLACEHOLDER = re.compile(r"sha256:<[^>]*>")
NAME = "<name>"


def _section(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model under a field and how its keys extend the field's path: `.` (a model or
    an optional one), `[].` (a list of them), `.<name>.` (a mapping of names to them)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return _section(args[0])
    if get_origin(annotation) is dict:
        return _submodel(args[1])[0], f".{NAME}."
    sub, is_list = _submodel(annotation)
    return sub, "[]." if is_list else "."


def config_keys(model: type[BaseModel] = GatewayConfig, prefix: str = "") -> Iterator[str]:
    """Every key path of the configuration: `queue.max_length`, `engines[].url`,
    `slo.classes.<name>.ttft_s`, …"""
    for name, field in model.model_fields.items():
        yield prefix + name
        sub, joint = _section(field.annotation)
        if sub is not None:
            yield from config_keys(sub, prefix + name + joint)


def example_keys(
    data: dict[str, Any], model: type[BaseModel] = GatewayConfig, prefix: str = ""
) -> Iterator[str]:
    """The key paths `data` sets, spelt as `config_keys` spells them (any name in a mapping
    of sections is `<name>`)."""
    for key, value in data.items():
        yield prefix + key
        field = model.model_fields.get(key)
        sub, joint = _section(field.annotation) if field is not None else (None, "")
        if sub is None:
            continue
        if joint == "[].":
            items = value if isinstance(value, list) else []
        elif joint == f".{NAME}.":
            items = list(value.values()) if isinstance(value, dict) else []
        else:
            items = [value]
        for item in items:
            if isinstance(item, dict):
                yield from example_keys(item, sub, prefix + key + joint)


def uncommented(text: str) -> str:
    """`text` with every commented-out key made live."""
    return "\n".join(COMMENTED_KEY.sub(r"\1\2", line) for line in text.splitlines())


def _everything(text: str) -> dict[str, Any]:
    data = yaml.safe_load(uncommented(text))
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def text() -> str:
    return EXAMPLE.read_text()


def test_every_key_is_in_the_example_and_every_key_there_exists(text: str) -> None:
    shown = set(example_keys(_everything(text)))
    missing = [k for k in config_keys() if k not in shown]
    assert not missing, (
        "config/example.yaml lacks these keys (add each, live or as `# key: value`, with a "
        f"comment): {missing}"
    )
    stale = sorted(shown - set(config_keys()))
    assert not stale, f"config/example.yaml names keys the models do not have: {stale}"


def test_the_example_with_every_commented_key_live_is_accepted(text: str) -> None:
    """A commented-out value is one the gateway would take (placeholders for key digests
    aside, each given a digest of its own)."""
    digests = iter(f"sha256:{i:064x}" for i in range(1, 1000))
    parse_config(_everything(KEY_PLACEHOLDER.sub(lambda _: next(digests), text)))


SAMPLE = """
engines:
  - url: http://a
    # kv_events: tcp://a:5557     # a list item's key, commented out
slo:
  classes:
    gold: {ttft_s: 1}
  # A prose line: never made live.
  # calibrate: true
models:
  # - name: m
  #   media:
  #     fetch: {timeout_s: 5}
"""


def test_keys_are_found_at_any_depth_live_or_commented_out() -> None:
    assert set(example_keys(_everything(SAMPLE))) == {
        "engines",
        "engines[].url",
        "engines[].kv_events",
        "slo",
        "slo.classes",
        "slo.classes.<name>.ttft_s",
        "slo.calibrate",
        "models",
        "models[].name",
        "models[].media",
        "models[].media.fetch",
        "models[].media.fetch.timeout_s",
    }
