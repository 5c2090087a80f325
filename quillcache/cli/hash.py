"""``quillcache hash TOKENS...``: the chained block hashes of a token sequence (Dynamo-compatible).

Token ids come from the arguments, or whitespace/comma separated from stdin. Prints one line per
full block, ``<index>\\t<hash as 16 hex digits>``. A token that is not an integer, or a parameter
``hash_blocks`` refuses (e.g. ``--block-size 0``), prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tokens", nargs="*", help="token ids (default: read whitespace/comma separated ids from stdin)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--lora", default=None, help="LoRA adapter name mixed into the seed")
    parser.add_argument("--namespace", default=None, help="namespace mixed into the seed")


def run(args: argparse.Namespace) -> int:
    from quillcache.hashing.blocks import hash_blocks

    raw = args.tokens or sys.stdin.read().replace(",", " ").split()
    try:
        tokens = [int(t) for t in raw]
    except ValueError as exc:
        print(f"quillcache hash: token ids must be integers ({exc})", file=sys.stderr)
        return 2
    try:
        hashes = hash_blocks(tokens, args.block_size, lora=args.lora, namespace=args.namespace)
    except (ValueError, TypeError) as exc:
        print(f"quillcache hash: {exc}", file=sys.stderr)
        return 2
    if not len(hashes):
        print(f"quillcache hash: {len(tokens)} token(s) make no full block of {args.block_size} tokens, so there is "
              f"no block hash (pass at least {args.block_size} tokens, or a smaller --block-size)", file=sys.stderr)
        return 2
    for i, h in enumerate(hashes):
        print(f"{i}\t{int(h):016x}")
    return 0
