"""``quillcache cluster``: a pool on this machine (``up``) and a pool's state (``status``).

- ``quillcache cluster up --nodes N [--dram SIZE] [--ssd] [--etcd] [--dir D] [--client-ttl-s S]
  [--lease-ttl-s S]``: a :class:`~quillcache.pool.cluster.LocalCluster` (a master and N node processes on
  127.0.0.1, N at most ``MAX_NODES``); a bad flag (a SIZE not a multiple of 4096, a TTL out of the master's
  range, a ``--dir`` that is a file, ``--dram`` x ``--nodes`` above what this machine has available: every node
  maps and touches its DRAM at start) is refused with one line and exit 2 before anything starts; prints one
  JSON line (master address, nodes with their addresses, base dir, the transfer secret's environment
  variable name) and runs until Ctrl-C, SIGTERM or SIGHUP, then stops every child and removes the temporary
  base dir (exit 0). The same signals during startup stop what was started, say so, and exit 130 / 128 + the
  signal (``quillcache.cli.signals``).
- ``quillcache cluster status --master ADDR [--json]``: a table of the pool's nodes and segments
  (capacity, used) and its totals (objects, pending puts).
"""

from __future__ import annotations

import argparse

from quillcache.cli import argtypes

SERVE_POLL_S = 3600.0  # the serving loop's sleep: any signal ends it at once
MAX_STATUS_TIMEOUT_S = 3600.0  # cluster status --timeout-s: an hour is already far more than a master needs


def configure(parser: argparse.ArgumentParser) -> None:
    from quillcache.master.types import MAX_DURATION_S
    from quillcache.pool.cluster import MAX_NODES

    ttl = argtypes.positive_float_up_to(MAX_DURATION_S)  # what `quillcache master` takes: refused here, not there

    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start a master and N nodes on 127.0.0.1 and run until Ctrl-C",
                        description=f"Start a master and N `quillcache node` processes (1..{MAX_NODES}) on "
                                    f"127.0.0.1 free ports, print one JSON line (the master's address, every "
                                    f"node's pid and addresses, the base dir and the transfer secret) once every "
                                    f"node is mounted, and run until Ctrl-C, SIGTERM or SIGHUP; then every child "
                                    f"is stopped and a temporary base dir removed (also when stopped while "
                                    f"starting).")
    up.add_argument("--nodes", type=argtypes.int_in_range(1, MAX_NODES), default=3,
                    help=f"number of node processes, 1..{MAX_NODES} (default 3)")
    up.add_argument("--dram", type=argtypes.size_arg, default=256 << 20, metavar="SIZE",
                    help="DRAM per node, a multiple of 4096 bytes (default 256MiB); --dram x --nodes at most 75%% "
                         "of the memory available (MemAvailable, or a cgroup's limit)")
    up.add_argument("--ssd", action="store_true", help="give every node an SSD tier under --dir")
    up.add_argument("--etcd", action="store_true", help="start an etcd and register the nodes in it")
    up.add_argument("--dir", help="base directory, created when missing and kept afterwards (logs, master data, "
                                  "SSD tiers; default: a temporary one, removed at exit)")
    up.add_argument("--client-ttl-s", type=ttl, default=3.0,
                    help=f"seconds without a heartbeat before the master expires a node, in (0, {MAX_DURATION_S:g}] "
                         f"(default %(default)g)")
    up.add_argument("--lease-ttl-s", type=ttl, default=2.0,
                    help=f"read lease TTL in seconds, in (0, {MAX_DURATION_S:g}] (default %(default)g)")
    st = sub.add_parser("status", help="show a pool's nodes, segments and usage",
                        description="Ask the master at ADDR for its pool: a table of the nodes and their segments "
                                    "(capacity, used) and the totals (objects, pending puts), or the same as one "
                                    "JSON object with --json. Exit status 1 when the master does not answer "
                                    "within --timeout-s, 2 for a malformed address or timeout.")
    st.add_argument("--master", required=True, type=argtypes.address, metavar="ADDR",
                    help="the master's address (tcp://HOST:PORT)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--timeout-s", type=argtypes.positive_float_up_to(MAX_STATUS_TIMEOUT_S), default=5.0,
                    help=f"how long to wait for the master, at most {MAX_STATUS_TIMEOUT_S:g} (default %(default)g)")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def run(args: argparse.Namespace) -> int:
    return _up(args) if args.action == "up" else _status(args)


def _up(args) -> int:
    import json
    import sys
    import time

    from quillcache.cli.signals import describe, exit_status
    from quillcache.pool.cluster import ClusterError, LocalCluster

    problem = argtypes.memory_problem(f"--dram x --nodes {args.nodes}", args.nodes * args.dram, "--dram or --nodes")
    if problem:  # every node maps and touches its --dram at start
        print(f"quillcache cluster up: {problem}", file=sys.stderr)
        return 2
    if args.dir is not None:
        problem = argtypes.directory_problem("--dir", args.dir)  # (creates a missing one, as start would)
        if problem:
            print(f"quillcache cluster up: {problem}", file=sys.stderr)
            return 2
    cluster = LocalCluster(args.nodes, dram_bytes=args.dram, ssd=args.ssd, etcd=args.etcd, base_dir=args.dir,
                           client_ttl_s=args.client_ttl_s, lease_ttl_s=args.lease_ttl_s)
    try:
        try:
            cluster.start()  # stops what it started before raising, whatever the exception
        except (ClusterError, OSError) as e:
            print(f"quillcache cluster up: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP (main turns them into this)
            print(f"quillcache cluster up: {describe(exc)} while starting; every process it started was stopped",
                  file=sys.stderr)
            return exit_status(exc)
        up = json.dumps({"master": cluster.master_address, "master_pid": cluster.master_pid,
                         "base_dir": str(cluster.base_dir),
                         "secret_env": "QUILLCACHE_TRANSFER_SECRET", "secret": cluster.secret,
                         "etcd": cluster.etcd.endpoint if cluster.etcd is not None else None,
                         "etcd_pid": cluster.etcd.pid if cluster.etcd is not None else None,
                         "nodes": [{"node_id": n.node_id, "pid": n.pid, "transfer": n.transfer_address,
                                    "control": n.control_address} for n in cluster.nodes]})
        # the print is inside the try: a signal handled right after the line went out (a reader that stops the
        # cluster as soon as it sees it) is the normal stop, not an interrupted start
        try:
            print(up, flush=True)
            while True:
                time.sleep(SERVE_POLL_S)
        except KeyboardInterrupt:  # the way to stop it: every child is stopped below
            return 0
    finally:
        cluster.close()


def _status(args) -> int:
    import dataclasses
    import json
    import sys

    from quillcache.master.client import MasterClient
    from quillcache.pool.cluster import status_of

    try:
        with MasterClient(args.master, timeout_s=args.timeout_s, retry_s=args.timeout_s) as m:
            st = status_of(m, args.master)
    except Exception as e:
        print(f"quillcache cluster status: the master at {args.master} did not answer: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dataclasses.asdict(st)))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"pool at {st.master_address}",
              caption=f"{st.segments} segments, {st.clients} nodes, {st.objects} objects "
                      f"({st.pending} puts pending), used {_mib(st.used_bytes)} of {_mib(st.capacity_bytes)}")
    for col in ("node", "segment", "endpoint", "capacity", "used", "used %"):
        t.add_column(col, justify="right" if col in ("capacity", "used", "used %") else "left")
    for n in st.nodes:
        pct = 100.0 * n.used_bytes / n.capacity_bytes if n.capacity_bytes else 0.0
        t.add_row(n.node_id, str(n.segment_id), n.endpoint, _mib(n.capacity_bytes), _mib(n.used_bytes), f"{pct:.1f}")
    Console(width=120).print(t)
    return 0
