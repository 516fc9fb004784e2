"""Build the project's own tiny tokenizer: ``gateway/assets/tiny-tokenizer/``.

A byte-level BPE (vocab 2048) trained with the ``tokenizers`` library on the top-level ``.py``
files of the running Python's standard library, sorted by name, so the build needs no download
and is deterministic for a given Python version. The output is a Hugging Face
``PreTrainedTokenizerFast`` directory written without ``transformers``:

- ``tokenizer.json``: the ``tokenizers`` model. No post-processor adds special tokens, so
  ``encode(text)`` never inserts ``<|bos|>``/``<|eos|>``; only the chat template adds the ChatML
  markers. Completions and chat prompts are therefore counted the same way by ``tokenizers``,
  ``transformers`` and vLLM (which tokenizes rendered chat prompts with
  ``add_special_tokens=False``).
- ``tokenizer_config.json``: class, special tokens, ``model_max_length``, ChatML ``chat_template``.
- ``special_tokens_map.json``.

Usage::

    python tools/build_tokenizer.py [--out DIR] [--check]

``--check`` rebuilds into a temporary directory and fails if the result differs from ``--out``.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2048
# Informational for transformers (it only warns above it); engines take max_model_len from
# the model config, not from the tokenizer.
MODEL_MAX_LENGTH = 4096
PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]

# ChatML, with tools, tool calls and documents rendered as Qwen2.5's and Hermes' templates render
# them, and Qwen3's `enable_thinking=False` switch. A conversation without tools, documents or
# tool messages renders exactly as plain ChatML: every other test's counts stay as they were.
# Content is rendered as a string: vLLM detects that this template does not iterate over
# message['content'] and joins OpenAI text parts with "\n" before rendering (its "string"
# content format); gateway.tokens does the same. No BOS is emitted, no default system prompt.
CHAT_TEMPLATE = (
    "{%- set skip_system = (tools or documents) and messages[0]['role'] == 'system' %}"
    "{%- if tools or documents %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if skip_system %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{%- if tools %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>\' }}'
    "{%- endif %}"
    "{%- if documents %}"
    "{{- ('\\n\\n' if tools else '') + '# Documents' }}"
    "{%- for document in documents %}"
    "{{- '\\n\\n## ' ~ document.title ~ '\\n' ~ document.text }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and skip_system %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' ~ tool_call.name ~ \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' ~ message['content'] ~ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "gateway" / "assets" / "tiny-tokenizer"


def training_files() -> list[Path]:
    """The corpus: top-level stdlib modules, sorted, so the order never depends on the OS."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise SystemExit(f"no .py files found in the standard library at {stdlib}")
    return files


def iter_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train(files: list[Path]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets only fixes offsets; it adds no tokens (unlike TemplateProcessing).
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(files), trainer=trainer)
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, object]:
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        # The template adds what is needed; never prepend BOS/append EOS on encode.
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict[str, object]:
    return {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n")


def build(out: Path) -> None:
    files = training_files()
    tokenizer = train(files)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained vocab is {tokenizer.get_vocab_size()}, expected {VOCAB_SIZE}")
    for index, tok in enumerate(SPECIAL_TOKENS):
        # Special tokens take the first ids, in SPECIAL_TOKENS order (pad=0, bos=1, eos=2, ...).
        if tokenizer.token_to_id(tok) != index:
            raise SystemExit(f"special token {tok} got id {tokenizer.token_to_id(tok)}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer))
    write_json(out / "special_tokens_map.json", special_tokens_map())
    print(
        f"wrote {out} (vocab {VOCAB_SIZE}, trained on {len(files)} files of "
        f"Python {sys.version_info.major}.{sys.version_info.minor} stdlib)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--check", action="store_true", help="rebuild to a temp dir and compare with --out"
    )
    args = parser.parse_args(argv)
    if not args.check:
        build(args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        _, mismatch, errors = filecmp.cmpfiles(tmp, args.out, names, shallow=False)
        if mismatch or errors:
            print(f"differs from {args.out}: {mismatch + errors}", file=sys.stderr)
            return 1
    print(f"{args.out} is up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
