"""The ``quillcache`` command line: one module per subcommand, registered by name in ``COMMANDS``.

Contract:
- ``COMMANDS`` is a :class:`~quillcache.registry.Registry` of :class:`Command` (help text and the
  module that implements it); a command module exposes ``configure(parser)`` and
  ``run(args) -> int`` and imports its heavy dependencies inside ``run``, so ``quillcache info``
  never pays for the harness. A new command is one module and one line here.
- Errors in user input exit with status 2 and a one-line message naming what was wrong (and the
  flag the user typed), no traceback; argparse's own errors are one line too (``OneLineParser``).
- Ctrl-C prints one line and exits 130; a command says whether partial results were written. A
  command registered with ``stop_signals=True`` (one that starts processes or writes files) gets
  SIGTERM and SIGHUP the same way (``quillcache.cli.signals``: its cleanup runs, exit 128 + the
  signal number).
- Output piped into a reader that stops early (``| head``): the command exits quietly with status 141
  (128 + SIGPIPE, as a shell reports a process SIGPIPE stopped), no traceback (``BrokenPipeError``).
- Only the command named on the command line is configured (its module imported), inside the same
  Ctrl-C handling as its run: ``quillcache info`` never imports another command's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
from dataclasses import dataclass
from types import ModuleType

from quillcache.cli.signals import describe, exit_status, stop_signals_interrupt
from quillcache.registry import Registry

__all__ = ["BROKEN_PIPE_STATUS", "COMMANDS", "Command", "main"]

BROKEN_PIPE_STATUS = 141  # 128 + SIGPIPE: the reader of stdout stopped early


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help and the module (``configure``, ``run``) that implements it."""

    help: str
    module: str
    stop_signals: bool = False  # SIGTERM/SIGHUP handled like Ctrl-C while it runs (quillcache.cli.signals)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


COMMANDS: Registry[Command] = Registry("command")
COMMANDS.register("info", Command("show versions and whether the compiled cores load", "quillcache.cli.info"))
COMMANDS.register("hash", Command("print the chained block hashes of a token sequence (Dynamo-compatible)",
                                  "quillcache.cli.hash"))
COMMANDS.register("replay", Command("replay a request trace through the router, planner, store tiers and an "
                                    "engine model", "quillcache.cli.replay", stop_signals=True))
COMMANDS.register("master", Command("serve the master (object metadata) over the network, alone or as an HA "
                                    "candidate through etcd", "quillcache.cli.master"))
COMMANDS.register("node", Command("contribute DRAM (and an SSD tier) to the pool as a node of a master",
                                  "quillcache.cli.node"))
COMMANDS.register("cluster", Command("run a master and N pool nodes on this machine (up), or show a pool (status)",
                                     "quillcache.cli.cluster", stop_signals=True))
COMMANDS.register("gateway", Command("serve the OpenAI-compatible streaming gateway (cache-aware, identity-guarded "
                                     "routing over engines)", "quillcache.cli.gateway"))
COMMANDS.register("engine-sim", Command("serve a STAND-IN engine (OpenAI-compatible, engine-model timing, block "
                                        "cache, vLLM KV events, fault knobs)", "quillcache.cli.engine_sim"))
COMMANDS.register("hitrate", Command("hit rate of eviction policies at several capacities and the share of the "
                                     "LRU-to-Belady gap each closes", "quillcache.cli.hitrate", stop_signals=True))
COMMANDS.register("gen-trace", Command("write a generated trace (multi-turn sessions, or the identity-collision "
                                       "workload)", "quillcache.cli.gen_trace", stop_signals=True))


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message (see prog --help)``, exit 2, no usage block.

    argparse reads a value that starts with ``-`` and is not a plain negative number (``-1%``, ``-inf``) as the
    next option and reports the flag before it as missing its value; that message says how to pass such a
    value (``--flag=-1%``), so the user learns the value was seen and why it was not taken."""

    def error(self, message: str):  # type: ignore[override]
        if message.endswith(("expected one argument", "expected at least one argument")):
            message += " (a value that starts with '-' is written with '=': --option=-VALUE)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command_named(argv: list[str]) -> str | None:
    """The subcommand on the command line: the first word that is not an option (the top-level parser
    has no option taking a value), or None (``quillcache --help``)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = OneLineParser(prog="quillcache", description="QuillCache KV-cache pool and control plane")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    broken: dict[str, str] = {}
    chosen = _command_named(argv)
    try:
        for name, command in COMMANDS.items():
            parser = sub.add_parser(name, help=command.help, description=command.help)
            if name != chosen:  # not run: its options (and the imports they need) are not needed
                continue
            try:
                command.load().configure(parser)
            except ImportError as exc:  # e.g. a compiled core that did not build: the other commands still work
                broken[name] = f"{type(exc).__name__}: {exc}"
                parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        args = ap.parse_args(argv)
        if args.command in broken:
            print(f"quillcache {args.command}: unavailable ({broken[args.command]}); `quillcache info` says which "
                  f"compiled core is missing, `make install` rebuilds them", file=sys.stderr)
            return 1
        command = COMMANDS[args.command]
        if not command.stop_signals:
            status = command.load().run(args)
        else:
            with stop_signals_interrupt():
                status = command.load().run(args)
        try:  # here, not at exit: a reader gone by now is a BrokenPipeError handled below
            sys.stdout.flush()
        except KeyboardInterrupt:  # the command is done: a stop signal as its output goes out ends it normally
            pass
        return status
    except BrokenPipeError:
        if not _stdout_is_broken():  # another pipe or socket of the command's: not the reader's doing
            raise
        # the reader of stdout stopped early (| head): nothing more can be said there, and Python's own
        # flush at exit must not fail again, so stdout goes to /dev/null (the documented idiom)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_STATUS
    except KeyboardInterrupt as exc:
        # Ctrl-C (or, for a stop_signals command, SIGTERM/SIGHUP): one line, 128 + the signal, no traceback
        print(f"quillcache: {describe(exc)}", file=sys.stderr)
        return exit_status(exc)


def _stdout_is_broken() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll reports an error or hang-up on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no real descriptor (captured, closed): not a broken pipe
        return False


if __name__ == "__main__":
    sys.exit(main())
