"""The ``quillcache`` command line: one module per subcommand, registered by name in ``COMMANDS``.

Contract:
- ``COMMANDS`` is a :class:`~quillcache.registry.Registry` of :class:`Command` (help text and the
  module that implements it); a command module exposes ``configure(parser)`` and
  ``run(args) -> int`` and imports its heavy dependencies inside ``run``, so ``quillcache info``
  never pays for the harness. A new command is one module and one line here.
- Errors in user input exit with status 2 and a one-line message naming what was wrong (and the
  flag the user typed), no traceback; argparse's own errors are one line too (``OneLineParser``).
- Ctrl-C prints one line and exits 130; a command says whether partial results were written.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

from quillcache.registry import Registry

__all__ = ["COMMANDS", "Command", "main"]


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help and the module (``configure``, ``run``) that implements it."""

    help: str
    module: str

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


COMMANDS: Registry[Command] = Registry("command")
COMMANDS.register("info", Command("show versions and whether the compiled cores load", "quillcache.cli.info"))
COMMANDS.register("hash", Command("print the chained block hashes of a token sequence (Dynamo-compatible)",
                                  "quillcache.cli.hash"))
COMMANDS.register("replay", Command("replay a request trace through the router, planner, store tiers and an "
                                    "engine model", "quillcache.cli.replay"))
COMMANDS.register("master", Command("serve the master (object metadata) over the network, alone or as an HA "
                                    "candidate through etcd", "quillcache.cli.master"))
COMMANDS.register("node", Command("contribute DRAM (and an SSD tier) to the pool as a node of a master",
                                  "quillcache.cli.node"))
COMMANDS.register("cluster", Command("run a master and N pool nodes on this machine (up), or show a pool (status)",
                                     "quillcache.cli.cluster"))
COMMANDS.register("gateway", Command("serve the OpenAI-compatible streaming gateway (cache-aware, identity-guarded "
                                     "routing over engines)", "quillcache.cli.gateway"))
COMMANDS.register("engine-sim", Command("serve a STAND-IN engine (OpenAI-compatible, engine-model timing, block "
                                        "cache, vLLM KV events, fault knobs)", "quillcache.cli.engine_sim"))
COMMANDS.register("hitrate", Command("hit rate of eviction policies at several capacities and the share of the "
                                     "LRU-to-Belady gap each closes", "quillcache.cli.hitrate"))
COMMANDS.register("gen-trace", Command("write a generated trace (multi-turn sessions, or the identity-collision "
                                       "workload)", "quillcache.cli.gen_trace"))


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message (see prog --help)``, exit 2, no usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="quillcache", description="QuillCache KV-cache pool and control plane")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    broken: dict[str, str] = {}
    for name, command in COMMANDS.items():
        parser = sub.add_parser(name, help=command.help, description=command.help)
        try:
            command.load().configure(parser)
        except ImportError as exc:  # e.g. a compiled core that did not build: the other commands still work
            broken[name] = f"{type(exc).__name__}: {exc}"
            parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    try:
        args = ap.parse_args(argv)
        if args.command in broken:
            print(f"quillcache {args.command}: unavailable ({broken[args.command]}); `quillcache info` says which "
                  f"compiled core is missing, `make install` rebuilds them", file=sys.stderr)
            return 1
        return COMMANDS[args.command].load().run(args)
    except KeyboardInterrupt:
        # Ctrl-C: one line, the conventional status of SIGINT (128 + 2), no traceback
        print("quillcache: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
