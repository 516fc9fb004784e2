"""The gateway's version: the installed distribution's, else the source tree's."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kv-gateway")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.6.0+source"
