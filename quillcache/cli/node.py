"""``quillcache node``: contribute DRAM (and an SSD tier) to the pool (a :class:`~quillcache.pool.node.PoolNode`).

``quillcache node --master ADDR --dram SIZE [--ssd DIR] [--ssd-size SIZE] [--etcd HOST:PORT] [--host H]
[--port P] [--control-port P] [--node-id ID] [--heartbeat-s S]``. SIZE is bytes or a number with a unit
(``256MiB``, ``1GiB``, ``512KiB``), a multiple of 4096 bytes (``4097`` or ``1MB`` is refused, not rounded).
The transfer secret comes from ``QUILLCACHE_TRANSFER_SECRET`` (at least 16 bytes). Prints ONE JSON line when
serving: ``{"node_id", "segment_id", "transfer", "control", "pid"}``; logs go to stderr; SIGTERM/SIGINT stop it
cleanly (it unmounts), exit 0. Bad flags, a missing or short secret, an ``--ssd`` that is not a directory (or
cannot be made one), a ``--dram`` above what this machine has available (``argtypes.memory_problem``: the
segment is mapped and touched at start): one line naming it, exit 2, before anything starts.
"""

from __future__ import annotations

import argparse

from quillcache.cli import argtypes


def configure(parser: argparse.ArgumentParser) -> None:
    from quillcache.pool.node import MAX_HEARTBEAT_S
    from quillcache.transfer import SECRET_ENV
    from quillcache.transfer.backends.tcp import MIN_SECRET_BYTES

    parser.epilog = (f"environment: {SECRET_ENV} is required: the pool's shared transfer secret (at least "
                     f"{MIN_SECRET_BYTES} bytes, the same for every node and client of the pool; never sent). "
                     f"`quillcache cluster up` prints the one its nodes use.")
    parser.add_argument("--master", required=True, type=argtypes.address, metavar="ADDR",
                        help="the master's address (tcp://HOST:PORT)")
    parser.add_argument("--dram", required=True, type=argtypes.size_arg, metavar="SIZE",
                        help="DRAM to contribute, a multiple of 4096 bytes, e.g. 1GiB; at most 75%% of the memory "
                             "available (MemAvailable, or a cgroup's limit): it is allocated and touched at start")
    parser.add_argument("--ssd", metavar="DIR",
                        help="SSD tier directory, created when missing (write-behind; re-announced at restart)")
    parser.add_argument("--ssd-size", type=argtypes.size_arg, metavar="SIZE",
                        help="SSD tier capacity, a multiple of 4096 bytes (default 4x --dram)")
    parser.add_argument("--etcd", metavar="HOST:PORT", help="register in the etcd node registry")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=argtypes.port, default=0, help="transfer engine port (default 0: a free one)")
    parser.add_argument("--control-port", type=argtypes.port, default=0, help="control RPC port (default 0: a free one)")
    parser.add_argument("--node-id", help="this node's id (default node-HOST-PID-RANDOM); keep it across restarts")
    parser.add_argument("--heartbeat-s", type=argtypes.positive_float_up_to(MAX_HEARTBEAT_S), default=1.0,
                        help=f"seconds between heartbeats, at most {MAX_HEARTBEAT_S:g} (keep <= the master's client "
                             f"TTL / 3; default 1)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _secret_problem(secret: str | None) -> str | None:
    """Why the transfer secret from the environment would make the node fail to start, or None: checked before
    any work (the transfer backend would refuse it only after the DRAM is mapped and the control RPC is up)."""
    from quillcache.transfer import SECRET_ENV
    from quillcache.transfer.backends.tcp import MIN_SECRET_BYTES

    if not secret:
        return (f"set {SECRET_ENV} (the pool's shared transfer secret, at least {MIN_SECRET_BYTES} bytes; "
                f"`quillcache cluster up` prints the one its nodes use)")
    try:
        n = len(secret.encode("utf-8"))
    except UnicodeEncodeError:  # undecodable bytes in the environment (surrogate escapes)
        return f"{SECRET_ENV} is not valid UTF-8: the transfer secret must be UTF-8 text"
    if n < MIN_SECRET_BYTES:
        return (f"{SECRET_ENV} is {n} byte(s); the pool's transfer secret must be at least {MIN_SECRET_BYTES} "
                f"bytes (the same for every node and client of the pool)")
    return None


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import os
    import signal
    import sys
    import threading

    from quillcache.cli.parent import parent_watch

    parent_gone = parent_watch()  # first: the parent may die while this node starts
    if args.ssd_size is not None and args.ssd is None:
        print("quillcache node: --ssd-size needs --ssd DIR", file=sys.stderr)
        return 2
    from quillcache.transfer import SECRET_ENV

    problem = _secret_problem(os.environ.get(SECRET_ENV))
    if problem:
        print(f"quillcache node: {problem}", file=sys.stderr)
        return 2
    if args.etcd:
        from quillcache.cluster.client import parse_endpoint

        try:
            parse_endpoint(args.etcd)
        except ValueError as e:
            print(f"quillcache node: --etcd: {e}", file=sys.stderr)
            return 2
    problem = argtypes.memory_problem("--dram", args.dram, "--dram")
    if problem:
        print(f"quillcache node: {problem}", file=sys.stderr)
        return 2
    if args.ssd is not None:
        problem = argtypes.directory_problem("--ssd", args.ssd)  # (creates a missing one, as the node would)
        if problem:
            print(f"quillcache node: {problem}", file=sys.stderr)
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
            if parent_gone():
                logging.getLogger("quillcache.node").warning("the process that started this node is gone: stopping")
                break
        return 0
    finally:
        node.close()
