"""Token counting: the project's tokenizer and counters chosen per model by a spec string."""

from gateway.tokens.errors import (
    ChatTemplateError,
    EngineTokenizeError,
    PromptTypeError,
    TokenCountError,
    TokenizerLoadError,
)
from gateway.tokens.hf import BUNDLED_TOKENIZER_DIR, HfTokenizer, bundled_tokenizer_path

__all__ = [
    "BUNDLED_TOKENIZER_DIR",
    "ChatTemplateError",
    "EngineTokenizeError",
    "HfTokenizer",
    "PromptTypeError",
    "TokenCountError",
    "TokenizerLoadError",
    "bundled_tokenizer_path",
]
