"""kv-gateway: an OpenAI-compatible gateway that protects vLLM engines from overload."""

from gateway.version import __version__

__all__ = ["__version__"]
