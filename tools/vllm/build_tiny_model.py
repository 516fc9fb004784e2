"""Build the tiny random-weight Llama-style model that the real-vLLM end-to-end tests serve.

Run with the vLLM environment's python (it has torch and transformers; no downloads):

    .venv-vllm/bin/python tools/vllm/build_tiny_model.py [--out DIR] [--tokenizer DIR]

The model directory holds the weights (safetensors, ~3.3 MB, fixed seed) and a copy of the
project's own tokenizer (`gateway/assets/tiny-tokenizer/`), so that the gateway's `hf:` counter
and vLLM's `/tokenize` read the very same tokenizer. The config's bos/eos/pad ids are the ids of
the tokenizer's special tokens. KV per token in fp32: 2 (K,V) x 2 layers x 2 kv heads x 32 x 4 B
= 1,024 B, so a 128-token block is 128 KiB.

A directory whose stamp matches the tokenizer files and the geometry below is left as it is;
a new build is written beside it and renamed into place, so an interrupted build never leaves a
directory that looks complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".cache" / "vllm" / "tiny-llama"
DEFAULT_TOKENIZER = REPO / "gateway" / "assets" / "tiny-tokenizer"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MODEL_FILES = ("config.json", "model.safetensors")
STAMP = "kv-gateway-build.json"
SEED = 0
GEOMETRY = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
}


def stamp_for(tokenizer_dir: Path) -> dict[str, object]:
    """What a complete build of `tokenizer_dir` must record; any change forces a rebuild."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        digest.update(name.encode())
        digest.update((tokenizer_dir / name).read_bytes())
    return {"tokenizer_sha256": digest.hexdigest(), "geometry": GEOMETRY, "seed": SEED}


def is_complete(out: Path, stamp: dict[str, object]) -> bool:
    if not all((out / name).is_file() for name in (*MODEL_FILES, *TOKENIZER_FILES, STAMP)):
        return False
    try:
        return bool(json.loads((out / STAMP).read_text()) == stamp)
    except ValueError:
        return False


def special_token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """bos/eos/pad token ids, read from the tokenizer itself (names from its config)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    names = json.loads((tokenizer_dir / "special_tokens_map.json").read_text())
    ids: dict[str, int] = {}
    for role in ("bos", "eos", "pad"):
        entry = names.get(f"{role}_token")
        if entry is None:
            continue
        content = entry["content"] if isinstance(entry, dict) else entry
        token_id = tokenizer.token_to_id(content)
        if token_id is None:
            raise SystemExit(f"{role}_token {content!r} is not in {tokenizer_dir}/tokenizer.json")
        ids[f"{role}_token_id"] = token_id
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > GEOMETRY["vocab_size"]:
        raise SystemExit(f"tokenizer has {vocab} tokens, the model only {GEOMETRY['vocab_size']}")
    return ids


def build(out: Path, tokenizer_dir: Path, stamp: dict[str, object]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = special_token_ids(tokenizer_dir)
    torch.manual_seed(SEED)
    config = LlamaConfig(**GEOMETRY, dtype="float32", **ids)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = ids.get("bos_token_id")
    model.generation_config.eos_token_id = ids.get("eos_token_id")
    model.generation_config.pad_token_id = ids.get("pad_token_id")

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, staging / name)
        (staging / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to make")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    args = parser.parse_args(argv)

    missing = [n for n in TOKENIZER_FILES if not (args.tokenizer / n).is_file()]
    if missing:
        print(f"build_tiny_model: {args.tokenizer} lacks {', '.join(missing)}", file=sys.stderr)
        return 1
    stamp = stamp_for(args.tokenizer)
    if is_complete(args.out, stamp):
        print(f"build_tiny_model: {args.out} is complete, not rebuilt")
        return 0
    build(args.out, args.tokenizer, stamp)
    print(f"build_tiny_model: built {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
