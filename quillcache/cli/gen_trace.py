"""``quillcache gen-trace``: write a generated trace (JSON Lines; schemas in ``traces/README.md``).

    quillcache gen-trace sessions  --out FILE [--seed S] [--sessions N | --requests N] [options]
    quillcache gen-trace collision --out FILE [--seed S] [--requests N] [--mix realistic|adversarial]

Both are deterministic from ``--seed``; ``quillcache replay FILE`` and
:func:`quillcache.traces.loader.load_trace` read the result. The file is written to a temporary name
(``.NAME.tmpPID``) beside it and renamed into place, so a failed or stopped run never leaves a
half-written trace: an error, Ctrl-C, SIGTERM or SIGHUP removes the temporary file, leaves ``--out``
as it was and says so (exit status 130 or 128 + the signal). ``--out`` must be a regular file or a
new name: anything else there (a device, fifo, socket or folder) is refused and left as it is, and
nothing under ``SYSTEM_DIRS`` is ever replaced; a symlink is followed: its target is replaced, the
link kept. Bad parameters or an unwritable path: a one-line message on stderr and exit status 2, no
traceback; a refused value is named by the flag typed (``FLAGS``: every option's config field). Every
line is checked with the loader's own line check before the file is written, so gen-trace never
writes a trace (nor an empty one) that the loader ``replay``/``hitrate`` read it with would refuse: such
knobs are refused. The replay's engine rules are not checked here: a prompt or output larger than an
engine's GPU KV (``--max-input-tokens``, ``--block-tokens``) is refused or skipped by ``replay`` itself.
A trace is built in memory whole: ``--sessions``/``--requests`` stop at ``MAX_TRACE_REQUESTS``, ``--tenants``
at ``MAX_TENANTS``, and the generation stops (exit 2, one line naming the flags) once the trace would take
more than ``argtypes.MEMORY_SHARE`` of the memory available; a ``MemoryError`` all the same is one line too.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path

__all__ = ["SYSTEM_DIRS", "configure", "main", "run"]

# never replaced, whatever --out says (after following symlinks): devices and kernel interfaces
SYSTEM_DIRS = (Path("/dev"), Path("/proc"), Path("/sys"))
# what an existing --out that is not a regular file is, by its stat.S_IFMT type
FILE_KINDS = {stat.S_IFDIR: "directory", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
              stat.S_IFIFO: "fifo (named pipe)", stat.S_IFSOCK: "socket",
              stat.S_IFLNK: "symlink that resolves to no file (a loop)"}

_EPILOG = """examples:
  quillcache gen-trace sessions --out sessions.jsonl --sessions 2000 --seed 1
  quillcache gen-trace sessions --out s.jsonl --requests 10000 --tenants 32 --mean-turns 6
  quillcache gen-trace collision --out adv.jsonl --mix adversarial --requests 5000
then: quillcache replay sessions.jsonl

limits: a trace is built in memory before it is written: --sessions and --requests are at most {requests:,},
--tenants at most {tenants:,}, and a trace that would take more than {share:.0%} of the memory available
(about 12 KB a sessions request at the defaults; longer prompts and more turns take more) is refused."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None`` ones (options that are off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``sessions`` and ``collision`` sub-commands and their options to ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    from quillcache.cli.argtypes import MEMORY_SHARE
    from quillcache.traces.sessions import MAX_TENANTS, MAX_TRACE_REQUESTS

    parser.epilog = _EPILOG.format(requests=MAX_TRACE_REQUESTS, tenants=MAX_TENANTS, share=MEMORY_SHARE)
    sub = parser.add_subparsers(dest="workload", required=True, metavar="{sessions,collision}")
    s = sub.add_parser("sessions", help="multi-tenant multi-turn sessions with shared system prompts",
                       description="Multi-tenant, multi-turn chat sessions with shared system prompts "
                                   "(quillcache.traces.sessions).",
                       formatter_class=_Formatter)
    _common(s)
    size = s.add_mutually_exclusive_group()
    size.add_argument("--sessions", type=int, default=None, metavar="N",
                      help=f"number of sessions, all turns (default 1000, at most {MAX_TRACE_REQUESTS:,})")
    size.add_argument("--requests", type=int, default=None, metavar="N",
                      help=f"exactly the first N requests by arrival instead (at most {MAX_TRACE_REQUESTS:,})")
    s.add_argument("--block-tokens", type=int, default=16, metavar="N", help="tokens per hash_ids block")
    s.add_argument("--tenants", type=int, default=None, metavar="N",
                   help=f"number of tenants (default 8, at most {MAX_TENANTS:,})")
    s.add_argument("--tenant-skew", type=float, default=0.8, metavar="X", help="Zipf exponent of tenant popularity")
    s.add_argument("--adapter-fraction", type=float, default=0.25, metavar="X",
                   help="tenants that serve a LoRA adapter")
    s.add_argument("--global-prompts", type=int, default=2, metavar="N", help="provider-wide system prompts")
    s.add_argument("--global-prompt-tokens", type=int, default=1024, metavar="N", help="tokens of a global system prompt")
    s.add_argument("--global-prompt-fraction", type=float, default=0.5, metavar="X", help="sessions that start with one")
    s.add_argument("--tenant-prompts", type=int, default=2, metavar="N", help="private system prompts per tenant")
    s.add_argument("--tenant-prompt-tokens", type=int, default=512, metavar="N", help="tokens of a tenant system prompt (0 = none)")
    s.add_argument("--mean-turns", type=float, default=4.0, metavar="X", help="mean turns per session (geometric)")
    s.add_argument("--max-turns", type=int, default=32, metavar="N", help="turns per session at most")
    s.add_argument("--think-time-s", type=float, default=20.0, metavar="X", help="median gap between turns (log-normal), seconds")
    s.add_argument("--first-user-tokens", type=float, default=400.0, metavar="X", help="mean user tokens of a first turn")
    s.add_argument("--turn-user-tokens", type=float, default=120.0, metavar="X", help="mean new user tokens per later turn")
    s.add_argument("--output-tokens", type=float, default=250.0, metavar="X", help="mean answer tokens")
    s.add_argument("--session-rate", type=float, default=1.0, metavar="X", help="new sessions per second (Poisson)")
    s.add_argument("--max-input-tokens", type=int, default=32768, metavar="N", help="a session ends before exceeding this")
    s.add_argument("--kv-dtype", default="bfloat16", help="KV dtype written on every line")
    c = sub.add_parser("collision", help="identity-collision workload (tenants x adapters x models)",
                       description="The collision workload of the safety study (quillcache.traces.collision).",
                       formatter_class=_Formatter)
    _common(c)
    c.add_argument("--requests", type=int, default=10_000, metavar="N",
                   help=f"number of requests (at most {MAX_TRACE_REQUESTS:,})")
    c.add_argument("--mix", default="realistic", help="realistic or adversarial")
    c.add_argument("--block-tokens", type=int, default=16, metavar="N", help="tokens per hash_ids block")
    c.add_argument("--tenants", type=int, default=None, metavar="N",
                   help=f"number of tenants (default 16, at most {MAX_TENANTS:,})")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True,
                   help="output .jsonl path: a new file, or a regular file replaced as a whole; a symlink's "
                        "target is replaced (the link kept); a device, fifo, socket or folder is refused")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (same seed -> same trace)")


# --tenants left out: the workload's own default, which may exceed a small trace's requests (only a
# number the user typed is refused for that, see _tenant_problem)
DEFAULT_TENANTS = {"sessions": 8, "collision": 16}


def _memory_budget() -> int | None:
    """The bytes a trace may take in memory (``argtypes.MEMORY_SHARE`` of what is available), None if unknown."""
    from quillcache.cli.argtypes import MEMORY_SHARE, available_memory_bytes

    have = available_memory_bytes()
    return int(MEMORY_SHARE * have) if have else None


def _generate(args: argparse.Namespace) -> tuple[list, str]:
    tenants = DEFAULT_TENANTS[args.workload] if args.tenants is None else args.tenants
    if args.workload == "sessions":
        from quillcache.traces import sessions

        size = {"num_requests": args.requests} if args.requests is not None else \
            {"num_sessions": 1000 if args.sessions is None else args.sessions}
        cfg = sessions.SessionsConfig(
            **size, seed=args.seed, block_tokens=args.block_tokens, num_tenants=tenants,
            tenant_skew=args.tenant_skew, adapter_fraction=args.adapter_fraction, num_global_prompts=args.global_prompts,
            global_prompt_tokens=args.global_prompt_tokens, global_prompt_fraction=args.global_prompt_fraction,
            prompts_per_tenant=args.tenant_prompts, tenant_prompt_tokens=args.tenant_prompt_tokens,
            mean_turns=args.mean_turns, max_turns=args.max_turns, think_time_median_s=args.think_time_s,
            first_user_tokens_mean=args.first_user_tokens, turn_user_tokens_mean=args.turn_user_tokens,
            output_tokens_mean=args.output_tokens, session_rate_per_s=args.session_rate,
            max_input_tokens=args.max_input_tokens, kv_dtype=args.kv_dtype,
        )
        reqs = sessions.generate(cfg, max_bytes=_memory_budget())
        n_sessions = len({r.session_id for r in reqs})
        return reqs, f"{len(reqs)} requests of {n_sessions} sessions, {len({r.tenant for r in reqs})} tenants"
    from quillcache.traces import collision

    cfg = collision.CollisionConfig(mix=args.mix, num_requests=args.requests, seed=args.seed,
                                    block_size_tokens=args.block_tokens, num_tenants=tenants)
    reqs = collision.generate(cfg, max_bytes=_memory_budget())
    return reqs, f"{len(reqs)} {args.mix} collision requests, {len({r.tenant for r in reqs})} tenants"


def _out_problem(text: str) -> tuple[Path, str | None]:
    """The file ``--out text`` names (a symlink followed to its target) and why it cannot be written,
    or None: it must be a regular file or a new name in an existing folder, outside ``SYSTEM_DIRS``."""
    out = Path(text)
    if not text.strip():
        return out, f"--out {text!r} names no file"
    try:
        target = Path(os.path.realpath(out, strict=False))
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:  # a symlink loop, a name too long, a folder we may not search
        return out, f"--out {out}: {exc.strerror or exc}"
    named = f"--out {out}" if target == Path(os.path.abspath(out)) else f"--out {out} (a symlink to {target})"
    system = next((d for d in SYSTEM_DIRS if target == d or d in target.parents), None)
    if system is not None:
        return target, f"{named} is under {system}, a system folder; a trace needs a regular file elsewhere"
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = FILE_KINDS.get(stat.S_IFMT(st.st_mode), "special file")
        return target, f"{named} is a {kind}, not a regular file; it was left as it is"
    if not target.parent.is_dir():
        return target, f"{named}: folder {target.parent} does not exist"
    return target, None


class _Interrupted(Exception):
    """Ctrl-C or a stop signal while writing; ``written`` says whether the trace was already in place."""

    def __init__(self, cause: KeyboardInterrupt, written: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.written = written


def _write(reqs: list, workload: str, out: Path) -> None:
    """Write to ``.NAME.tmpPID`` beside ``out`` and rename it over ``out``; on any exception (an
    ``OSError``, Ctrl-C, a stop signal) the temporary file is removed and ``out`` is as it was
    unless the rename was done (``_Interrupted.written``)."""
    from quillcache.traces import collision, sessions

    writer = sessions.write_jsonl if workload == "sessions" else collision.write_jsonl
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    renamed = False
    try:
        writer(reqs, tmp)
        _, problem = _out_problem(str(out))  # again: something may have been put there meanwhile
        if problem:
            raise OSError(problem)
        os.replace(tmp, out)
        renamed = True
    except KeyboardInterrupt as exc:
        raise _Interrupted(exc, renamed) from None
    finally:
        if not renamed:
            tmp.unlink(missing_ok=True)


# config field -> the flag a user typed, so a refused value is named as it was given: every field
# that an option of configure() sets (test: each option's field maps to that option)
FLAGS = {"num_sessions": "--sessions", "num_requests": "--requests", "seed": "--seed", "num_tenants": "--tenants",
         "block_tokens": "--block-tokens", "block_size_tokens": "--block-tokens", "mix": "--mix",
         "tenant_skew": "--tenant-skew", "adapter_fraction": "--adapter-fraction",
         "num_global_prompts": "--global-prompts", "global_prompt_tokens": "--global-prompt-tokens",
         "global_prompt_fraction": "--global-prompt-fraction", "prompts_per_tenant": "--tenant-prompts",
         "tenant_prompt_tokens": "--tenant-prompt-tokens", "mean_turns": "--mean-turns", "max_turns": "--max-turns",
         "think_time_median_s": "--think-time-s", "first_user_tokens_mean": "--first-user-tokens",
         "turn_user_tokens_mean": "--turn-user-tokens", "output_tokens_mean": "--output-tokens",
         "session_rate_per_s": "--session-rate", "max_input_tokens": "--max-input-tokens", "kv_dtype": "--kv-dtype"}
# a config field as a whole word (not part of a longer name, nor already a flag such as "--mix")
_FIELD_RE = re.compile(r"(?<![\w-])(?:(?:SessionsConfig|CollisionConfig)\.)?(" + "|".join(
    sorted(map(re.escape, FLAGS), key=len, reverse=True)) + r")\b")


def _flagged(msg: str) -> str:
    """``msg`` with each config field (``SessionsConfig.mean_turns``, ``max_input_tokens``) replaced by
    its flag (``--mean-turns``); other ``XConfig.`` prefixes dropped."""
    msg = _FIELD_RE.sub(lambda m: FLAGS[m.group(1)], msg)
    return re.sub(r"\b(?:SessionsConfig|CollisionConfig)\.", "", msg)


def _tenant_problem(args: argparse.Namespace) -> str | None:
    """More tenants typed than requests (or sessions) cannot all appear: say so instead of silently fewer."""
    count, flag = ((args.requests, "--requests") if args.workload == "collision" or args.requests is not None
                   else (args.sessions if args.sessions is not None else 1000, "--sessions"))
    if args.tenants is not None and isinstance(count, int) and 0 < count < args.tenants:
        return (f"--tenants {args.tenants} is more than {flag} {count}: each {flag[2:-1]} has one tenant, so at most "
                f"{count} tenants can appear; lower --tenants or raise {flag}")
    return None


def run(args: argparse.Namespace) -> int:
    """Generate and write the trace ``args`` describe; 0 on success, 2 (with a message) on bad input,
    130 / 128 + the signal on Ctrl-C / SIGTERM / SIGHUP (saying whether the trace was written)."""
    from quillcache.cli.signals import describe, exit_status

    prog = "quillcache gen-trace"
    out = Path(args.out)
    target, problem = _out_problem(args.out)
    problem = _tenant_problem(args) or problem
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        return 2
    try:
        try:
            reqs, what = _generate(args)
            _write(reqs, args.workload, target)  # a line the loader would refuse: TraceError, nothing written
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: a safety net, knobs are bounded
            print(f"{prog}: {_flagged(str(exc))}", file=sys.stderr)
            return 2
        except MemoryError:  # a safety net under the memory budget (another process took the memory meanwhile)
            size = "--requests" if args.workload == "collision" or args.requests is not None else "--sessions"
            print(f"{prog}: out of memory while generating the trace; lower {size}; nothing was written to {out}",
                  file=sys.stderr)
            return 2
    except KeyboardInterrupt as exc:
        print(f"{prog}: {describe(exc)}; nothing was written to {out} (it is as it was)", file=sys.stderr)
        return exit_status(exc)
    except _Interrupted as exc:
        said = f"the trace was written to {out} first" if exc.written else \
            f"nothing was written to {out} (it is as it was)"
        print(f"{prog}: {describe(exc.cause)}; {said}", file=sys.stderr)
        return exit_status(exc.cause)
    except OSError as exc:  # no errno: _out_problem's refusal, found again just before the rename
        print(f"{prog}: {exc}" if exc.errno is None else f"{prog}: cannot write {out}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    print(f"wrote {what} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="quillcache gen-trace", description=__doc__.splitlines()[0])
    configure(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
