"""kv-gateway: an OpenAI-compatible gateway that protects vLLM engines from overload."""

__version__ = "0.1.0"
