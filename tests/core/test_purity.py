"""gateway/core must stay pure: no I/O libraries, no clock, no global randomness."""

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "gateway" / "core"
FORBIDDEN_MODULES = {
    "asyncio",
    "httpx",
    "redis",
    "starlette",
    "uvicorn",
    "aiohttp",
    "socket",
    "time",
    "random",
    "os",
    "subprocess",
    "threading",
    "requests",
}


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_imports_no_io(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN_MODULES, f"{path.name} imports {imported & FORBIDDEN_MODULES}"


def test_core_has_modules() -> None:
    assert len(list(CORE.glob("*.py"))) >= 6
