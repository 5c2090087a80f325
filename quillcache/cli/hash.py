"""``quillcache hash TOKENS...``: the chained block hashes of a token sequence (Dynamo-compatible).

Token ids come from the arguments, or whitespace/comma separated from stdin. Prints one line per
full block, ``<index>\\t<hash as 16 hex digits>``. A token that is not an integer in [0, 2**32), a
``--block-size`` outside [1, 65536], or a ``--lora``/``--namespace`` that is not UTF-8 text (both are hashed
as UTF-8) prints one line on stderr naming the flag or token and exits 2; the flags are checked before stdin
is read.
"""

from __future__ import annotations

import argparse
import os
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    from quillcache.hashing.blocks import MAX_BLOCK_SIZE  # (run imports it anyway)

    parser.add_argument("tokens", nargs="*", help="token ids (default: read whitespace/comma separated ids from stdin)")
    parser.add_argument("--block-size", type=int, default=16,
                        help=f"tokens per block, 1..{MAX_BLOCK_SIZE} (default 16)")
    parser.add_argument("--lora", default=None, help="LoRA adapter name mixed into the seed (UTF-8 text)")
    parser.add_argument("--namespace", default=None, help="namespace mixed into the seed (UTF-8 text)")


def _flag_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a flag, naming it as typed, or None (``hash_blocks``' own check would say
    ``block_size=0`` or an encoder's error, not the flag)."""
    from quillcache.hashing.blocks import MAX_BLOCK_SIZE

    if not 1 <= args.block_size <= MAX_BLOCK_SIZE:
        return f"--block-size: block_size={args.block_size} must be in [1, {MAX_BLOCK_SIZE}] (tokens per block)"
    for flag, value in (("--lora", args.lora), ("--namespace", args.namespace)):
        if value is None:
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode arrive as surrogate escapes
            return f"{flag} {os.fsencode(value)!r} is not valid UTF-8 (it is hashed as UTF-8 text)"
    return None


def run(args: argparse.Namespace) -> int:
    from quillcache.hashing.blocks import hash_blocks

    problem = _flag_problem(args)
    if problem:
        print(f"quillcache hash: {problem}", file=sys.stderr)
        return 2
    raw = args.tokens or sys.stdin.read().replace(",", " ").split()
    for i, t in enumerate(raw):  # ASCII decimal digits only (int() would also take '1_000' or '\uff11')
        if not (t.isascii() and t.isdigit()):
            print(f"quillcache hash: token ids must be integers written in ASCII digits 0-9; token {i} is {t!r:.40}",
                  file=sys.stderr)
            return 2
        if len(t.lstrip("0")) > 10:  # past 2**32 - 1 by length: refused before int() (which caps its digits)
            print(f"quillcache hash: tokens[{i}] ({len(t):,} digits) is out of range; token ids must be in "
                  f"[0, 2**32)", file=sys.stderr)
            return 2
    tokens = [int(t) for t in raw]
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
