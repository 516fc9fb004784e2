"""`kv-gateway hash-key`: the sha256 digest of an API key, for `tenants[].api_keys`.

The gateway stores only digests; a key is compared by hashing what the client presents.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import sys

from gateway.config import DIGEST_PREFIX


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "key", nargs="?", help="the API key (omit to read it from stdin or a hidden prompt)"
    )


def run(args: argparse.Namespace) -> int:
    key = args.key
    if key is None:
        key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline()
    key = key.strip()
    if not key:
        print("kv-gateway hash-key: empty key", file=sys.stderr)
        return 2
    print(DIGEST_PREFIX + digest(key))
    return 0
