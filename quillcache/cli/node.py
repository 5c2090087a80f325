"""``quillcache node``: contribute DRAM (and an SSD tier) to the pool (a :class:`~quillcache.pool.node.PoolNode`).

``quillcache node --master ADDR --dram SIZE [--ssd DIR] [--ssd-size SIZE] [--etcd HOST:PORT] [--host H]
[--port P] [--control-port P] [--node-id ID] [--heartbeat-s S]``. SIZE is bytes or a number with a unit
(``256MiB``, ``1GiB``, ``512KiB``, ``2MB``). The transfer secret comes from ``QUILLCACHE_TRANSFER_SECRET``.
Prints ONE JSON line when serving: ``{"node_id", "segment_id", "transfer", "control", "pid"}``; logs go to
stderr; SIGTERM/SIGINT stop it cleanly (it unmounts), exit 0. Bad flags: one line, exit 2.
"""

from __future__ import annotations

import argparse

from quillcache.cli import argtypes


def configure(parser: argparse.ArgumentParser) -> None:
    from quillcache.transfer import SECRET_ENV
    from quillcache.transfer.backends.tcp import MIN_SECRET_BYTES

    parser.epilog = (f"environment: {SECRET_ENV} is required: the pool's shared transfer secret (at least "
                     f"{MIN_SECRET_BYTES} bytes, the same for every node and client of the pool; never sent). "
                     f"`quillcache cluster up` prints the one its nodes use.")
    parser.add_argument("--master", required=True, metavar="ADDR", help="the master's address (tcp://HOST:PORT)")
    parser.add_argument("--dram", required=True, type=argtypes.size_arg, metavar="SIZE", help="DRAM to contribute, e.g. 1GiB")
    parser.add_argument("--ssd", metavar="DIR", help="SSD tier directory (write-behind; re-announced at restart)")
    parser.add_argument("--ssd-size", type=argtypes.size_arg, metavar="SIZE", help="SSD tier capacity (default 4x --dram)")
    parser.add_argument("--etcd", metavar="HOST:PORT", help="register in the etcd node registry")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=argtypes.port, default=0, help="transfer engine port (default 0: a free one)")
    parser.add_argument("--control-port", type=argtypes.port, default=0, help="control RPC port (default 0: a free one)")
    parser.add_argument("--node-id", help="this node's id (default node-HOST-PID-RANDOM); keep it across restarts")
    parser.add_argument("--heartbeat-s", type=argtypes.positive_float, default=1.0,
                        help="seconds between heartbeats (keep <= the master's client TTL / 3; default 1)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import os
    import signal
    import sys
    import threading

    from quillcache.transfer import SECRET_ENV

    if args.ssd_size is not None and not args.ssd:
        print("quillcache node: --ssd-size needs --ssd DIR", file=sys.stderr)
        return 2
    if args.etcd:
        from quillcache.cluster.client import parse_endpoint

        try:
            parse_endpoint(args.etcd)
        except ValueError as e:
            print(f"quillcache node: --etcd: {e}", file=sys.stderr)
            return 2
    if not os.environ.get(SECRET_ENV):
        print(f"quillcache node: set {SECRET_ENV} (the cluster's shared transfer secret, >= 16 bytes)",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from quillcache.pool.node import PoolNode

    try:
        node = PoolNode(args.master, dram_bytes=args.dram, ssd_dir=args.ssd, ssd_bytes=args.ssd_size, etcd=args.etcd,
                        node_id=args.node_id, host=args.host, port=args.port, control_port=args.control_port,
                        heartbeat_s=args.heartbeat_s)
    except Exception as e:
        print(f"quillcache node: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps({"node_id": node.node_id, "segment_id": node.segment_id, "transfer": node.transfer_address,
                          "control": node.control_address, "pid": os.getpid(),
                          "reannounced": node.counters.reannounced}), flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        node.close()
