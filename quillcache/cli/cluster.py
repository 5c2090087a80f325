"""``quillcache cluster``: a pool on this machine (``up``) and a pool's state (``status``).

- ``quillcache cluster up --nodes N [--dram SIZE] [--ssd] [--etcd] [--dir D] [--client-ttl-s S]
  [--lease-ttl-s S]``: a :class:`~quillcache.pool.cluster.LocalCluster` (a master and N node processes on
  127.0.0.1); prints one JSON line (master address, nodes with their addresses, base dir, the transfer
  secret's environment variable name) and runs until Ctrl-C or SIGTERM, then stops every child.
- ``quillcache cluster status --master ADDR [--json]``: a table of the pool's nodes and segments
  (capacity, used) and its totals (objects, pending puts).
"""

from __future__ import annotations

import argparse

from quillcache.cli import argtypes





def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start a master and N nodes on 127.0.0.1 and run until Ctrl-C")
    up.add_argument("--nodes", type=argtypes.positive_int, default=3, help="number of node processes (default 3)")
    up.add_argument("--dram", type=argtypes.size_arg, default=256 << 20, metavar="SIZE", help="DRAM per node (default 256MiB)")
    up.add_argument("--ssd", action="store_true", help="give every node an SSD tier under --dir")
    up.add_argument("--etcd", action="store_true", help="start an etcd and register the nodes in it")
    up.add_argument("--dir", help="base directory (logs, master data, SSD tiers; default: a temporary one)")
    up.add_argument("--client-ttl-s", type=argtypes.positive_float, default=3.0, help="node expiry TTL (default 3)")
    up.add_argument("--lease-ttl-s", type=argtypes.positive_float, default=2.0, help="read lease TTL (default 2)")
    st = sub.add_parser("status", help="show a pool's nodes, segments and usage")
    st.add_argument("--master", required=True, metavar="ADDR", help="the master's address (tcp://HOST:PORT)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--timeout-s", type=argtypes.positive_float, default=5.0, help="how long to wait for the master")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def run(args: argparse.Namespace) -> int:
    return _up(args) if args.action == "up" else _status(args)


def _up(args) -> int:
    import json
    import signal
    import sys
    import threading

    from quillcache.pool.cluster import ClusterError, LocalCluster

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = LocalCluster(args.nodes, dram_bytes=args.dram, ssd=args.ssd, etcd=args.etcd, base_dir=args.dir,
                           client_ttl_s=args.client_ttl_s, lease_ttl_s=args.lease_ttl_s)
    try:
        try:
            cluster.start()
        except (ClusterError, OSError) as e:
            print(f"quillcache cluster up: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"master": cluster.master_address, "base_dir": str(cluster.base_dir),
                          "secret_env": "QUILLCACHE_TRANSFER_SECRET", "secret": cluster.secret,
                          "etcd": cluster.etcd.endpoint if cluster.etcd is not None else None,
                          "nodes": [{"node_id": n.node_id, "pid": n.pid, "transfer": n.transfer_address,
                                     "control": n.control_address} for n in cluster.nodes]}), flush=True)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
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
