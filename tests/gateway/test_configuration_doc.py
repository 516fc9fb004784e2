"""docs/configuration.md against the config models (gateway/config.py): every key of
`GatewayConfig`, nested sections included, has one row in the document's reference tables
with its type and default as the models have them, no row names a key that does not exist,
and every YAML example in the document is a configuration the gateway accepts.

A row is `| `key.path` | type | default | meaning |` in a table headed
`| key | type | default | meaning |`. The type is rendered from the annotation (below); the
default is `required`, or a YAML value in backticks (prose may follow it) that must validate
to the model's default. A failure prints the row the document should have.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import pytest
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from gateway.config import ENV_REDIS_URL, GatewayConfig, parse_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
HEADER = "| key | type | default | meaning |"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|([^|]*)\|([^|]*)\|")
A_DEFAULT = re.compile(r"`([^`]*)`")


# ---- what the models say -------------------------------------------------------------


def _submodel(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section model under a field (a model, an optional model, a list of models), and
    whether it is a list."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, types.UnionType) and len(args) == 1:
        return _submodel(args[0])
    if get_origin(annotation) is list:
        sub, _ = _submodel(args[0])
        return sub, True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def model_keys(
    model: type[BaseModel] = GatewayConfig, prefix: str = ""
) -> Iterator[tuple[str, FieldInfo]]:
    """Every key path of the configuration: `queue.max_length`, `engines[].url`, …"""
    for name, field in model.model_fields.items():
        path = prefix + name
        yield path, field
        sub, is_list = _submodel(field.annotation)
        if sub is not None:
            yield from model_keys(sub, path + ("[]." if is_list else "."))


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# A bound's sign in a one-sided range, its attribute, its bracket in an interval.
BOUNDS: dict[type, tuple[str, str, str]] = {
    at.Gt: (">", "gt", "("),
    at.Ge: ("≥", "ge", "["),
    at.Lt: ("<", "lt", ")"),
    at.Le: ("≤", "le", "]"),
}


def _bounded(kind: str, constraints: list[Any]) -> str:
    least = next((c.min_length for c in constraints if isinstance(c, at.MinLen)), None)
    if least is not None:
        kind += f" (at least {least})"
    low = next((c for c in constraints if isinstance(c, (at.Gt, at.Ge))), None)
    high = next((c for c in constraints if isinstance(c, (at.Lt, at.Le))), None)

    def value(bound: Any) -> str:
        return _number(getattr(bound, BOUNDS[type(bound)][1]))

    if low is not None and high is not None:
        opening, closing = BOUNDS[type(low)][2], BOUNDS[type(high)][2]
        return f"{kind} in {opening}{value(low)}, {value(high)}{closing}"
    for bound in (low, high):
        if bound is not None:
            return f"{kind} {BOUNDS[type(bound)][0]} {value(bound)}"
    return kind


SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def type_text(annotation: Any, constraints: list[Any]) -> str:
    """The type column: `integer > 0`, `number in (0, 1]`, `one of `a`, `b``, `mapping`,
    `list of strings`, each `… or null` when null is allowed."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        shown = [type_text(a, constraints) for a in args if a is not type(None)]
        return " or ".join(shown + ["null"] * (type(None) in args))
    if origin is Annotated:
        base, *extra = get_args(annotation)
        inner = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return type_text(base, constraints + inner)
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(annotation))
    if origin is list:
        (item,) = get_args(annotation)
        items = "mappings" if _submodel(item)[0] else SCALARS[item] + "s"
        return _bounded(f"list of {items}", constraints)
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return "mapping"
    return _bounded(SCALARS[annotation], constraints)


def expected_row(path: str, field: FieldInfo) -> str:
    shown = "required"
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(exclude_defaults=True)
        flow = yaml.safe_dump(default, default_flow_style=True).removesuffix("...\n")
        shown = f"`{flow.strip()}`"
    return f"| `{path}` | {type_text(field.annotation, field.metadata)} | {shown} | … |"


# ---- what the document says ------------------------------------------------------------


def documented_rows(text: str) -> dict[str, tuple[str, str]]:
    """key path → (type, default) from the document's reference tables."""
    rows: dict[str, tuple[str, str]] = {}
    in_table = False
    for line in text.splitlines():
        if line.strip() == HEADER:
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
        match = ROW.match(line) if in_table else None
        if match:
            key, kind, default = (g.strip() for g in match.groups())
            assert key not in rows, f"{key} is documented twice"
            rows[key] = (kind, default)
    return rows


@pytest.fixture(scope="module")
def rows() -> dict[str, tuple[str, str]]:
    return documented_rows(DOC.read_text())


def test_every_key_is_documented_and_every_documented_key_exists(
    rows: dict[str, tuple[str, str]],
) -> None:
    fields = dict(model_keys())
    missing = [expected_row(p, f) for p, f in fields.items() if p not in rows]
    assert not missing, "docs/configuration.md lacks rows like:\n" + "\n".join(missing)
    stale = sorted(set(rows) - set(fields))
    assert not stale, f"docs/configuration.md documents keys the models do not have: {stale}"


def test_every_documented_type_is_the_models(rows: dict[str, tuple[str, str]]) -> None:
    wrong = [
        expected_row(path, field)
        for path, field in model_keys()
        if path in rows and rows[path][0] != type_text(field.annotation, field.metadata)
    ]
    assert not wrong, "docs/configuration.md: types differ from the models:\n" + "\n".join(wrong)


def test_every_documented_default_is_the_models(rows: dict[str, tuple[str, str]]) -> None:
    wrong = []
    for path, field in model_keys():
        if path not in rows:
            continue
        cell = rows[path][1]
        if field.is_required() or cell == "required":
            if not (field.is_required() and cell == "required"):
                wrong.append(expected_row(path, field))
            continue
        value = A_DEFAULT.match(cell)
        documented = yaml.safe_load(value.group(1)) if value else object()
        try:
            as_model = TypeAdapter(field.annotation).validate_python(documented)
        except ValidationError:  # not even a value of the field's type
            as_model = object()
        if as_model != field.get_default(call_default_factory=True):
            wrong.append(expected_row(path, field))
    assert not wrong, "docs/configuration.md: defaults differ from the models:\n" + "\n".join(wrong)


def test_every_yaml_example_is_accepted() -> None:
    """Each section's example, with an engine added where it shows none."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 10
    for block in blocks:
        data = yaml.safe_load(block)
        data.setdefault("engines", [{"url": "http://127.0.0.1:8001"}])
        parse_config(data)


def test_the_environment_variable_is_named() -> None:
    assert ENV_REDIS_URL in DOC.read_text()
