"""The ``quillcache`` command line.

Subcommands are registered in ``COMMANDS`` (name → (help, configure, run)); later components
(trace replay, node, master, gateway) add themselves there. Errors in user input exit with
status 2 and a message naming what was wrong.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

_FAST_MODULES = ("quillcache.alloc._alloc", "quillcache.sketch._sketch", "quillcache.art._art", "quillcache.hashing._xxh3")


def _info_configure(p: argparse.ArgumentParser) -> None:
    del p


def _info_run(args: argparse.Namespace) -> int:
    import numpy

    import quillcache

    print(f"quillcache {quillcache.__version__} (numpy {numpy.__version__})")
    ok = True
    for name in _FAST_MODULES:
        try:
            importlib.import_module(name)
            print(f"  {name}: ok")
        except Exception as exc:  # report, do not crash: this is a diagnostic command
            ok = False
            print(f"  {name}: NOT AVAILABLE ({type(exc).__name__}: {exc})")
    return 0 if ok else 1


def _hash_configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("tokens", nargs="*", help="token ids (default: read whitespace/comma separated ids from stdin)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--lora", default=None, help="LoRA adapter name mixed into the seed")
    p.add_argument("--namespace", default=None, help="namespace mixed into the seed")


def _hash_run(args: argparse.Namespace) -> int:
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
    for i, h in enumerate(hashes):
        print(f"{i}\t{int(h):016x}")
    return 0


def _lazy(target: str) -> Callable:
    """``module:function``, imported when first called, so each command pulls in only its own code."""
    module, name = target.split(":")

    def call(arg):
        return getattr(importlib.import_module(module), name)(arg)

    call.__name__ = name
    return call


Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "info": ("show versions and whether the compiled cores load", _info_configure, _info_run),
    "hash": ("print the chained block hashes of a token sequence (Dynamo-compatible)", _hash_configure, _hash_run),
    "replay": ("replay a request trace through the router, planner, store tiers and an engine model",
               _lazy("quillcache.cli.replay:configure"), _lazy("quillcache.cli.replay:run")),
    "gen-trace": ("write a generated trace (multi-turn sessions, or the identity-collision workload)",
                  _lazy("quillcache.cli.gen_trace:configure"), _lazy("quillcache.cli.gen_trace:run")),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quillcache", description="QuillCache KV-cache pool and control plane")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (help_text, configure, _) in COMMANDS.items():
        configure(sub.add_parser(name, help=help_text, description=help_text))
    args = ap.parse_args(argv)
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
