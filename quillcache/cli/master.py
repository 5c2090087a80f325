"""``quillcache master``: serve the master over the network (the same as ``python -m quillcache.master``).

Single mode: ``quillcache master --data-dir D [--host 127.0.0.1] [--port 0] [--stream-port 0 | --no-stream]
[--stream-idle-timeout-s 60]``.
HA mode adds ``--etcd HOST:PORT --name NAME --candidate ID --ttl-s 5``. Prints one JSON line
``{"address", "stream_address", "pid", "role", "epoch"}`` when serving or standing by; logs go to stderr; SIGTERM stops it.
Every duration flag (``*-s``) takes seconds in (0, ``MAX_DURATION_S``] (one day; ``--warmup-s`` and
``--restart-budget-s`` also 0); anything else, 0 for a TTL included, is refused with exit 2 naming the flag.
Conflicting flags are refused with one line naming both (exit 2): ``--no-stream`` with ``--stream-port``,
``--port`` equal to a non-zero ``--stream-port``, and the HA flags (``--name``, ``--candidate``, ``--ttl-s``,
``--prefix``, ``--warmup-s``, ``--log-margin``) without ``--etcd``.
A data dir serves one master at a time: a second master on it is refused (exit 1, naming the holder's pid).
See :mod:`quillcache.master.server` and :mod:`quillcache.master.ha`.
"""

from __future__ import annotations

import argparse

from quillcache.cli import argtypes
from quillcache.master.server import MAX_STREAM_SPIN_US
from quillcache.master.types import MAX_DURATION_S, MasterConfig

# every duration flag (*-s) is a number of seconds in (0, MAX_DURATION_S] ([0, ...] where 0 has a meaning): a
# larger one is a typo, and would overflow the waits of the master's threads
_SECONDS = argtypes.positive_float_up_to(MAX_DURATION_S)


def _up_to(high: float):
    """A converter for a number in ``[0, high]`` (its message names the range)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not 0 <= value <= high:  # (NaN fails)
            raise argparse.ArgumentTypeError(f"{text!r} is not in [0, {high:.15g}]")
        return value

    convert.__name__ = f"number in [0, {high:.15g}]"
    return convert


# the HA flags' values when not typed (default None in the parser, so that one typed without --etcd is seen)
HA_DEFAULTS = {"name": "master", "ttl_s": 5, "prefix": "/quillcache", "warmup_s": 0.5, "log_margin": 10_000}


def _flag_problem(args: argparse.Namespace) -> str | None:
    """Flags that contradict each other, said naming both, or None; fills in the defaults left as None."""
    if args.no_stream and args.stream_port is not None:
        return f"--no-stream and --stream-port {args.stream_port} contradict each other: give one of them"
    if args.stream_port and args.stream_port == args.port:
        return f"--port and --stream-port are both {args.port}: the two transports need two ports (or 0: free ones)"
    typed = [f"--{name.replace('_', '-')}" for name in ("candidate", *HA_DEFAULTS) if getattr(args, name) is not None]
    if not args.etcd and typed:
        return f"{', '.join(typed)} need{'s' if len(typed) == 1 else ''} --etcd (HA mode)"
    if args.candidate is not None and not args.candidate.strip():
        return "--candidate is empty: give this candidate's id, or leave the flag out for HOSTNAME-PID"
    args.stream_port = None if args.no_stream else args.stream_port or 0
    for name, value in HA_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", required=True, help="directory of the operation log, snapshots and index")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=argtypes.port, default=0, help="port to listen on (default 0: a free one)")
    parser.add_argument("--stream-port", type=argtypes.port, default=None,
                        help="port of the plain-TCP transport (qtcp://, which MasterClient prefers; "
                             "default 0: a free one; not with --no-stream, nor the same as --port)")
    parser.add_argument("--stream-spin-us", type=_up_to(MAX_STREAM_SPIN_US), default=100.0,
                        help="microseconds a plain-TCP connection's thread polls for the next request before it "
                             f"sleeps (default 100; 0: never poll; at most {MAX_STREAM_SPIN_US:.0f}; see "
                             "quillcache.rpc.stream)")
    parser.add_argument("--stream-idle-timeout-s", type=_SECONDS, default=None,
                        help="seconds a plain-TCP connection may go without a request (or stall in one) before the "
                             "server closes it; clients reconnect transparently (default 60: "
                             "quillcache.rpc.stream.DEFAULT_IDLE_TIMEOUT_S)")
    parser.add_argument("--no-stream", action="store_true",
                        help="serve ZeroMQ only (no plain-TCP transport; not with --stream-port)")
    ha = parser.add_argument_group("high availability (etcd)", "every flag here but --etcd needs --etcd")
    ha.add_argument("--etcd", metavar="HOST:PORT", help="etcd endpoint: run as one candidate of an HA group")
    ha.add_argument("--name", default=None, help=f"the HA group's name (default {HA_DEFAULTS['name']!r})")
    ha.add_argument("--candidate", help="this candidate's id (default HOSTNAME-PID)")
    ha.add_argument("--ttl-s", type=argtypes.int_in_range(1, int(MAX_DURATION_S)), default=None,
                    help=f"leader lease TTL in seconds (default {HA_DEFAULTS['ttl_s']})")
    ha.add_argument("--prefix", default=None, help=f"etcd key prefix (default {HA_DEFAULTS['prefix']})")
    ha.add_argument("--warmup-s", type=_up_to(MAX_DURATION_S), default=None,
                    help=f"wait after winning the election before serving (default {HA_DEFAULTS['warmup_s']}; see "
                         f"quillcache.master.ha)")
    ha.add_argument("--log-margin", type=argtypes.positive_int, default=None,
                    help=f"log records kept in etcd below the leader's last snapshot (default "
                         f"{HA_DEFAULTS['log_margin']})")
    parser.add_argument("--snapshot-every-records", type=argtypes.positive_int, default=None,
                        help="snapshot after this many log records (default: MasterConfig's)")
    parser.add_argument("--restart-budget-s", type=_up_to(MAX_DURATION_S), default=None,
                        help="take snapshots as rarely as a restart within this many seconds allows (0: only the "
                             "--snapshot-every-records floor and the growth rule; default: MasterConfig's)")
    parser.add_argument("--snapshot-writer", choices=["fork", "inline"], default=None,
                        help="who writes snapshots: a forked child while the master serves (fork, the default) "
                             "or the serving thread (inline)")
    parser.add_argument("--sync-put-start", action="store_true",
                        help="fsync every put start too (default: a call that only starts puts is written to the "
                             "log and fsynced by the next call that changes anything else; a power loss can then "
                             "forget puts never ended, never a complete object)")
    parser.add_argument("--max-forgotten-keys", type=argtypes.int_in_range(0, 1 << 30), default=None,
                        help=f"dropped keys whose last word (last digest, or removed) the master remembers, so a "
                             f"node's older SSD copy is not put back; each costs its key's bytes plus about 130 in "
                             f"memory and about 35 in every snapshot (default {MasterConfig.max_forgotten_keys:,}, "
                             f"and 32 MiB of UTF-8 keys at most; 0: none)")
    parser.add_argument("--lease-ttl-s", type=_SECONDS, default=None,
                        help=f"read lease TTL in seconds, in (0, {MAX_DURATION_S:.0f}]; 0 is refused (exit 2), it "
                             f"does not mean 'no lease' or 'the default' (default {MasterConfig.lease_ttl_s:g}: "
                             f"MasterConfig.lease_ttl_s)")
    parser.add_argument("--client-ttl-s", type=_SECONDS, default=None,
                        help=f"seconds without a heartbeat before a node is expired, in (0, {MAX_DURATION_S:.0f}]; "
                             f"0 is refused (exit 2), it does not mean 'never expire' or 'the default' (default "
                             f"{MasterConfig.client_ttl_s:g}: MasterConfig.client_ttl_s)")
    parser.add_argument("--tick-s", type=_SECONDS, default=1.0,
                        help=f"seconds between timer runs: client expiry, zombie reclaim, eviction; at most "
                             f"{MAX_DURATION_S:.0f} (default 1)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="stderr log level (default info)")


def run(args: argparse.Namespace) -> int:
    import sys

    problem = _flag_problem(args)
    if problem:
        print(f"quillcache master: {problem}", file=sys.stderr)
        return 2
    if args.etcd:
        from quillcache.cluster.client import parse_endpoint
        from quillcache.cluster.descriptors import election_key

        try:
            parse_endpoint(args.etcd)
            election_key(args.name, args.prefix)  # the checks the etcd keys get
        except ValueError as e:
            print(f"quillcache master: {e} (--etcd / --name / --prefix)", file=sys.stderr)
            return 2
    from quillcache.master.server import run_server

    return run_server(args)
