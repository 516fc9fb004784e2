"""The `kv-gateway` command line: serve | demo | sim | plan | loadtest | hash-key.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their subcommand runs, so `serve` never loads the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gateway.version import __version__

# subcommand → (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the gateway from a YAML config"),
    "demo": ("gateway.demo", "two simulated engines and the gateway in front of them, no config"),
    "sim": ("gateway.sim.cli", "a simulated vLLM engine (OpenAI surface, KV blocks, /metrics)"),
    "plan": ("gateway.planner.cli", "capacity planner: GPU memory and utilization to KV blocks"),
    "loadtest": (
        "gateway.loadtest.cli",
        "load-test a deployment: run, compare targets, sweep a setting (docs/loadtest.md)",
    ),
    "hash-key": ("gateway.keys", "print the sha256 digest of an API key for the tenants config"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kv-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        # Arguments are added lazily below, once we know which subcommand is asked for.
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The subcommand's arguments (exits with a usage message on bad ones, as argparse does)."""
    parser = build_parser()
    # Find the subcommand first, then let its module declare its own arguments.
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in _COMMANDS:
        module = importlib.import_module(_COMMANDS[command][0])
        sub_action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        module.add_arguments(sub_action.choices[command])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    module = importlib.import_module(args._module)
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
