"""Token counting: counters chosen per model by a spec string, and the project's tokenizer.

See docs/tokens.md. ``make_counter(spec, model=...)`` is the entry point; ``HfTokenizer`` is the
tokenizer the simulator and the tests share with the gateway.
"""

from gateway.tokens.engine import EngineCounter
from gateway.tokens.errors import (
    ChatTemplateError,
    EngineTokenizeError,
    PromptTypeError,
    TokenCountError,
    TokenizerLoadError,
)
from gateway.tokens.estimate import EstimateCounter
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer, bundled_tokenizer_path
from gateway.tokens.local import HfCounter, TiktokenCounter
from gateway.tokens.protocol import OFFLOAD_CHARS, TokenCounter, prompt_token_counts
from gateway.tokens.spec import make_counter

__all__ = [
    "BUNDLED_TOKENIZER_DIR",
    "OFFLOAD_CHARS",
    "ChatTemplateError",
    "EngineCounter",
    "EngineTokenizeError",
    "EstimateCounter",
    "HfCounter",
    "HfTokenizer",
    "PromptTypeError",
    "TiktokenCounter",
    "TokenCountError",
    "TokenCounter",
    "TokenizerLoadError",
    "bundled_tokenizer_path",
    "make_counter",
    "prompt_token_counts",
]
