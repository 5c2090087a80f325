"""The master as a network service: ``python -m quillcache.master`` / ``quillcache master``.

Contract:
- ``run_server(args)`` (the argument list is :func:`quillcache.cli.master.configure`'s) opens the master
  over ``--data-dir`` (restart = snapshot + log tail), binds an :class:`~quillcache.rpc.RpcServer` on
  ``--host``/``--port`` (0: a free port) and, unless ``--no-stream``, a
  :class:`~quillcache.rpc.StreamServer` (the plain-TCP transport, ``qtcp://``) on ``--stream-port`` (0: a
  free port) serving the same endpoint; once serving (single mode or leader) or standing by (HA
  standby), it prints ONE line of JSON to stdout: ``{"address": "tcp://HOST:PORT", "stream_address":
  "qtcp://HOST:PORT"|null, "pid": N, "role": "leader"|"standby"|"single", "epoch": E}``; everything else goes to stderr (logging). SIGTERM or SIGINT
  stops it cleanly (the RPC server closes, an HA leader resigns, the service snapshots and closes), exit 0.
- Refused at start with one line on stderr and no traceback, nothing in the data dir changed (its lock file
  aside, :mod:`~quillcache.durability.dirlock`): exit 2 (``EXIT_BAD_FLAG``) for a flag value that cannot work
  (``--data-dir`` empty, not a directory, not creatable or not writable; a duration out of range, see
  ``MAX_DURATION_S``); exit 1 (``EXIT_CANNOT_START``) for a data dir that cannot be opened (in use by another
  master, named with its pid; a damaged, empty or foreign log or snapshot; an I/O error) or a port that cannot
  be bound. A timer thread (``--tick-s``) that breaks stops the process with exit 1: a master never goes on
  serving without its timer.
- Single mode (no ``--etcd``): the local WAL is the log, as ``MasterService(data_dir=D)``. HA mode
  (``--etcd HOST:PORT --name N --candidate ID --ttl-s T``): :class:`~quillcache.master.ha.HaMaster`.
  etcd down at start is one error line per attempt, retried with backoff until it answers.
- Served (whitelist): every ``MasterService`` method in :data:`~quillcache.master.wire.SERVICE_METHODS`
  (each per-key operation and its batch form) plus ``master_status()`` (role, epoch, lsn, leader, any
  role, and ``stream_address``: how a client finds the plain-TCP transport) and ``snapshot_bytes()``
  (leader/single: the state for a standby too far behind). A single master's status also holds ``recovery``:
  what its restart dropped (``MasterService.recovery_report`` as plain values; None without a data dir). In HA
  mode the leader record (etcd) names the ``qtcp://`` address when it is served, else ``HOST:PORT`` of the
  ZeroMQ one. Both transports carry the
  same calls to the same endpoint, so every check (frame limits, typed refusals, the role's admission
  and epoch fence) is the same on both. Calls reach the service one at a time (the node lock, shared with the ``tick()`` timer thread and the HA follower).
- The service runs with ``MasterConfig.defer_index_publish``: a call's residency-index rows are written
  after its reply is sent (the servers' ``after_reply`` hook) or, if another call comes first, before
  that call runs; either way under the node lock, so every call sees the index complete.
- Limits: a batch call carries at most :data:`~quillcache.master.wire.MAX_BATCH_KEYS` keys (requests, rows);
  a longer one is refused with INVALID_PARAMS naming the method, the count and the limit, before it takes the
  node lock or changes anything (one call runs under the lock that every other client waits for; writes stay
  one atomic record per call). ``MasterClient`` splits longer batches. The plain-TCP transport closes a
  connection idle for ``--stream-idle-timeout-s`` (:class:`~quillcache.rpc.StreamServer`'s ``idle_timeout_s``),
  so idle connections cannot hold its ``max_connections`` slots.
- Bad input from the network gets a typed error: a master refusal as its :class:`MasterError` class;
  arguments that do not bind as the RPC layer's BAD_ARGUMENTS; anything else the service raises on
  malformed values (TypeError, ValueError, ...) as INVALID_PARAMS naming the method. Batch results carry
  per-key errors as :class:`~quillcache.master.wire.BatchError` (the client turns them back); the
  compact methods' ``(segments, rows)`` go as one array ``[segments, rows]``; the columnar methods take
  their sizes as raw int64 bytes and answer raw arrays (wire.py ``COLUMNS_METHODS``): the per-call path
  adds one ``frombuffer`` and one ``tobytes`` per array to what the service does, nothing per key.
- Time is ``time.time`` (wall clock): records carry the writer's clock and another process (a restart, a
  standby on another host) compares its own clock with them.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from quillcache._checks import check_float
from quillcache.cli.argtypes import directory_problem
from quillcache.cli.parent import parent_watch
from quillcache.durability.wal import WalError
from quillcache.durability.dirlock import DataDirInUseError
from quillcache.master.errors import InvalidParamsError, MasterError
from quillcache.master.service import MasterService
from quillcache.master.types import MasterConfig
from quillcache.master.validate import check_duration_s
from quillcache.master.wire import (BATCH_METHODS, COLUMNS_METHODS, COMPACT_BATCH_METHODS, COMPACT_METHODS,
                                    MAX_BATCH_KEYS, NODE_METHODS, SERVICE_METHODS, decode_sizes, encode_batch,
                                    encode_columns, register_master_types)
from quillcache.rpc.errors import clip

__all__ = ["MasterEndpoint", "SingleMaster", "run_server"]

log = logging.getLogger(__name__)

EXIT_BAD_FLAG = 2  # a flag value that cannot work: --data-dir unusable as a directory, a duration out of range
EXIT_CANNOT_START = 1  # the data dir is damaged or in use, a port is taken, the timer failed
MAX_STREAM_SPIN_US = 1_000_000.0  # the longest a plain-TCP connection's thread polls for its next request (1 s)

_KEYS_ARG = {"get_replicas": "keys", "exists": "keys", "batch_put_start": "requests",
             "batch_put_start_returning": "requests", "batch_put_end": "keys",
             "batch_put_revoke": "keys", "batch_remove": "keys", "get_replicas_compact": "keys",
             "batch_put_start_compact": "rows", "batch_put_start_columns": "keys", "get_replicas_columns": "keys"}


class SingleMaster:
    """A master without HA: the service, its lock, always serving."""

    role = "single"

    def __init__(self, service: MasterService) -> None:
        self.service = service
        self.lock = threading.RLock()

    @classmethod
    def open(cls, data_dir: str | None, config: MasterConfig, clock: Callable[[], float] = time.time) -> SingleMaster:
        return cls(MasterService(config, clock=clock, data_dir=data_dir))

    def admit(self, method: str) -> None:
        pass

    def after_call(self) -> None:
        pass  # a failed log keeps answering LOG_FAILED for state changes and reads (until restarted)

    def status(self) -> dict:
        st = self.service.stats()
        rep = self.service.recovery_report
        return {"role": "single", "epoch": self.service.epoch, "lsn": st.lsn, "leader": None, "address": None,
                "objects": st.num_objects, "recovery": None if rep is None else rep.as_dict()}

    def tick(self) -> None:
        with self.lock:
            self.service.tick()

    def request_stop(self) -> None:
        pass

    def close(self) -> None:
        with self.lock:
            self.service.close()


class MasterEndpoint:
    """The RPC target: the whitelisted service methods, each under the node lock, admitted by the node's role."""

    def __init__(self, node, stream_address: str | None = None) -> None:
        self._node = node
        self.stream_address = stream_address  # the plain-TCP transport's qtcp:// address, when served
        for name in SERVICE_METHODS:
            setattr(self, name, self._wrap(name))

    def _wrap(self, name: str) -> Callable:
        node = self._node
        batch = name in BATCH_METHODS
        compact, compact_batch = name in COMPACT_METHODS, name in COMPACT_BATCH_METHODS
        columns, sized = name in COLUMNS_METHODS, name == "batch_put_start_columns"
        keys_arg = _KEYS_ARG.get(name)
        sig = inspect.signature(getattr(node.service, name))

        def call(*args, **kwargs):
            if keys_arg is not None:
                keys = args[0] if args else kwargs.get(keys_arg)
                if not isinstance(keys, (list, tuple)):
                    raise InvalidParamsError(f"{name}: {keys_arg} must be a list, got {type(keys).__name__}")
                if len(keys) > MAX_BATCH_KEYS:
                    raise InvalidParamsError(f"{name}: {len(keys)} {keys_arg} in one call is past the master's "
                                             f"limit of {MAX_BATCH_KEYS} per call (MAX_BATCH_KEYS); split the "
                                             f"batch (MasterClient does)")
            if sized:  # raw int64 bytes -> one array (wire.decode_sizes); a list passes as it is
                try:
                    if len(args) > 1:
                        args = (args[0], decode_sizes(args[1]), *args[2:])
                    elif "sizes" in kwargs:
                        kwargs["sizes"] = decode_sizes(kwargs["sizes"])
                except InvalidParamsError as e:
                    raise InvalidParamsError(f"{name}: {e.message}") from None
            with node.lock:
                node.admit(name)
                node.service.publish_index()  # what the call before deferred (MasterConfig.defer_index_publish)
                try:
                    out = getattr(node.service, name)(*args, **kwargs)
                except MasterError:
                    raise
                except TypeError as e:
                    try:
                        sig.bind(*args, **kwargs)
                    except TypeError:
                        raise e from None  # the RPC layer answers BAD_ARGUMENTS
                    raise InvalidParamsError(f"{name}: bad arguments ({clip(str(e))})") from None
                except (ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
                    raise InvalidParamsError(f"{name}: bad arguments ({type(e).__name__}: {clip(str(e))})") from None
                finally:
                    node.after_call()
            if compact:  # (segments, rows) as one native array; per-key errors as BatchError
                return [out[0], encode_batch(out[1]) if compact_batch else out[1]]
            if columns:  # [segments, errors, raw arrays...] (wire.encode_columns)
                return encode_columns(out)
            return encode_batch(out) if batch else out

        call.__name__ = name
        call.__doc__ = getattr(MasterService, name).__doc__
        call.__signature__ = sig  # type: ignore[attr-defined]
        return call

    def after_reply(self) -> None:
        """(The RPC servers' hook, after each reply is sent) publish the index rows the call deferred."""
        node = self._node
        with node.lock:
            node.service.publish_index()

    def master_status(self) -> dict:
        with self._node.lock:
            out = dict(self._node.status())
        out["stream_address"] = self.stream_address
        return out

    def snapshot_bytes(self) -> bytes:
        with self._node.lock:
            self._node.admit("snapshot_bytes")
            return self._node.service.snapshot_bytes()


def _config(args) -> MasterConfig:
    kw = {}
    for name in ("snapshot_every_records", "lease_ttl_s", "client_ttl_s", "snapshot_writer", "max_forgotten_keys"):
        if getattr(args, name, None) is not None:  # (0 is a value, refused by MasterService, not the default)
            kw[name] = getattr(args, name)
    if getattr(args, "restart_budget_s", None) is not None:
        kw["restart_budget_s"] = args.restart_budget_s
    if getattr(args, "sync_put_start", False):
        kw["sync_put_start"] = True
    kw["defer_index_publish"] = True  # published after each reply is sent and before each call (MasterEndpoint)
    return MasterConfig(**kw)


def _check_durations(args) -> None:
    """The duration arguments in range (ValueError naming the flag otherwise): the CLI's parser checks them
    too; this covers a caller that builds ``args`` itself."""
    check_duration_s("--tick-s", args.tick_s)
    if getattr(args, "stream_idle_timeout_s", None) is not None:
        check_duration_s("--stream-idle-timeout-s", args.stream_idle_timeout_s)
    check_float("--stream-spin-us", getattr(args, "stream_spin_us", 0.0), 0.0, MAX_STREAM_SPIN_US)


def _prepare_data_dir(path: str) -> str | None:
    """Create the data dir ``path`` when it is missing; what makes it unusable (a sentence naming it), or None.
    Reads and creates nothing else: what is inside is the service's business (its lock, then recovery)."""
    return directory_problem("--data-dir", path, writes="the master writes its log and snapshots there")


def run_server(args) -> int:
    """The process (module docstring); returns the exit status."""
    import zmq

    from quillcache.rpc import RpcServer, StreamServer
    from quillcache.rpc.stream import DEFAULT_IDLE_TIMEOUT_S
    from quillcache.master.snapshot import SnapshotError

    parent_gone = parent_watch()  # first: the parent may die while this master starts
    try:
        _check_durations(args)
    except ValueError as e:
        print(f"quillcache master: {e}", file=sys.stderr)
        return EXIT_BAD_FLAG
    problem = _prepare_data_dir(args.data_dir)
    if problem is not None:
        print(f"quillcache master: {problem}", file=sys.stderr)
        return EXIT_BAD_FLAG
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    node = None

    def on_signal(signum, _frame) -> None:
        stop.set()
        if node is not None:
            node.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if args.etcd:
            from quillcache.master.ha import HaMaster

            candidate = args.candidate or f"{socket.gethostname()}-{os.getpid()}"
            node = HaMaster(args.data_dir, _config(args), etcd=args.etcd, name=args.name, candidate=candidate,
                            ttl_s=args.ttl_s, prefix=args.prefix, warmup_s=args.warmup_s, log_margin=args.log_margin)
        else:
            node = SingleMaster.open(args.data_dir, _config(args))
    except DataDirInUseError as e:
        print(f"quillcache master: {e}", file=sys.stderr)
        return EXIT_CANNOT_START
    except (MasterError, SnapshotError, WalError, OSError, ValueError) as e:
        why = " ".join(str(e).split())  # one line, whatever the message holds
        print(f"quillcache master: cannot open the master in {args.data_dir}: {type(e).__name__}: {why}",
              file=sys.stderr)
        return EXIT_CANNOT_START
    register_master_types()
    endpoint = MasterEndpoint(node)
    methods = [*SERVICE_METHODS, *NODE_METHODS]
    server = RpcServer(endpoint, methods, args.host, args.port, name="master", after_reply=endpoint.after_reply)
    stream = None if args.stream_port is None else StreamServer(
        endpoint, methods, args.host, args.stream_port, spin_s=args.stream_spin_us * 1e-6,
        idle_timeout_s=getattr(args, "stream_idle_timeout_s", None) or DEFAULT_IDLE_TIMEOUT_S, name="master",
        after_reply=endpoint.after_reply)
    try:
        server.start()
        if stream is not None:
            stream.start()
            endpoint.stream_address = stream.address
    except (zmq.ZMQError, OSError) as e:
        print(f"quillcache master: cannot listen on {args.host} (port {args.port}, stream port "
              f"{args.stream_port}): {e}", file=sys.stderr)
        server.close()
        node.close()
        return 1
    ticker = None
    try:
        if args.etcd:
            # the leader record names the address clients should use: the plain-TCP one when it is served
            if not node.start(stream.address if stream is not None else f"{args.host}:{server.port}"):
                return 0  # stopped before etcd answered
            role = node.wait_decided(timeout_s=4.0 * args.ttl_s + 30.0)
            epoch = node.status()["epoch"] if role == "standby" else node.epoch
        else:
            role, epoch = "single", node.service.epoch
        if stop.is_set():
            return 0
        print(json.dumps({"address": server.address, "stream_address": endpoint.stream_address, "pid": os.getpid(),
                          "role": role, "epoch": epoch}), flush=True)
        log.info("master serving at %s as %s (epoch %s, lsn %d)", server.address, role, epoch, node.service.lsn)

        timer_failed: list[BaseException] = []

        def tick_loop() -> None:
            try:
                while not stop.wait(args.tick_s):
                    try:
                        node.tick()
                    except MasterError as e:
                        log.warning("tick: %s", e)
                    except Exception:
                        log.exception("tick failed")
            except BaseException as e:  # the timer itself broke: a master without it must not go on serving
                timer_failed.append(e)
                stop.set()

        ticker = threading.Thread(target=tick_loop, name="master-tick", daemon=True)
        ticker.start()
        while not stop.wait(0.5):
            if parent_gone():
                log.warning("the process that started this master is gone: stopping")
                break
        if timer_failed:
            e = timer_failed[0]
            print(f"quillcache master: the timer thread failed ({type(e).__name__}: {e}); stopping", file=sys.stderr)
            return EXIT_CANNOT_START
        log.info("master at %s stopping", server.address)
        return 0
    finally:
        stop.set()
        if stream is not None:
            stream.close()
        server.close()
        if ticker is not None:
            ticker.join(timeout=5)
        node.close()
