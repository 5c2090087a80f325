"""``MasterClient``: the master's client library (typed methods mirroring ``MasterService``).

Contract:
- ``MasterClient(address | [addresses] | etcd="HOST:PORT", timeout_s=5.0)``: over the network (an
  :class:`~quillcache.rpc.RpcClient`); ``MasterClient.embedded(service)``: the same calls on an in-process
  service, no sockets (values and errors still pass through the codec, so embedded behaves as remote).
- Transport: a ``qtcp://`` address is the plain-TCP transport (:mod:`quillcache.rpc.stream`), others ZeroMQ.
  Given one ZeroMQ address (and ``prefer_stream``, the default), the first call asks the server's
  ``master_status`` for its ``stream_address`` and, when there is one, goes on over plain TCP; a server that
  serves none (ZeroMQ only) keeps being called over ZeroMQ. When the plain-TCP server stops answering (a
  timeout or a lost connection) or turns the client away (``TOO_MANY_CONNECTIONS``) the client goes back to the
  ZeroMQ address and asks it again for the stream address: another one (a server restarted on the same ZeroMQ
  port with another stream port) is used at once, the same one only after :data:`STREAM_RETRY_AFTER_S` (until
  then calls go over ZeroMQ, which keeps serving when the plain-TCP port is saturated). A request that never left
  (a plain-TCP connection refused) or that was turned away (it did not run) is sent again at once over
  ZeroMQ, reads and writes alike, as ZeroMQ would have queued it for the restarting server. A plain-TCP
  connection the server closed for being idle is replaced without a retry (:mod:`quillcache.rpc.client`).
  Through etcd the leader record already names the address to use (``qtcp://`` when the leader serves it).
- With ``etcd`` the client finds the leader through the election record (``{prefix}/election/{name}``),
  waiting up to ``retry_s`` for one to exist; with several addresses it rotates through them.
- Retries, until ``retry_s`` has passed, with exponential backoff: NOT_LEADER answers (the call did not
  run) for every method, moving to the leader the record names; TOO_MANY_CONNECTIONS (the call did not run)
  for every method; timeouts (connection loss: the server died, or is paused) for reads and heartbeats, and
  for every method when the request was never sent (no connection could be made, e.g. to a leader that just
  died: it cannot have run). A state-changing call that timed out once sent is NOT resent (it may have run):
  ``RpcTimeoutError`` says so, and the
  next call goes to the leader found anew; ``retry_writes=True`` resends those as well (at-least-once: a repeated ``put_end(put_id=...)`` answers
  OBJECT_ALREADY_EXISTS "already complete", a repeated ``put_start`` with a digest ``existing=True``).
- Errors arrive typed: a master refusal as its :class:`~quillcache.master.MasterError` subclass (batch
  results hold those instances per key), RPC refusals as :class:`~quillcache.rpc.RpcRejectedError`.
- ``get_replicas``, ``get_replica_list``, ``put_start`` and ``batch_put_start`` travel in the compact
  forms (:mod:`quillcache.master.wire`, ``COMPACT_METHODS``) and are rebuilt into the same values
  and typed errors; a server that does not serve those (UNKNOWN_METHOD) gets the plain methods.
- ``batch_put_start_columns`` / ``get_replicas_columns`` return :class:`~quillcache.master.columns.PutColumns`
  / ``ReplicaColumns`` (one array per field), equal to what the service returns in-process: sizes travel as
  raw int64 bytes, the reply's arrays as raw bytes rebuilt with ``np.frombuffer`` (read-only arrays; no
  per-key Python work on this side) and checked; a malformed reply raises
  :class:`~quillcache.rpc.RpcProtocolError`. A server without them (UNKNOWN_METHOD) is asked for the
  compact forms instead, rebuilt into the same columns.
- Batches: the master refuses a batch call of more than :data:`~quillcache.master.wire.MAX_BATCH_KEYS` keys,
  so every batch method sends a longer batch as consecutive calls of at most that many keys, in order, and joins
  their results (one per key, in the caller's order). Each key is decided as in one call (as if the keys before
  it had been done). Each call is its own atomic record: an exception that ends a longer write batch part-way (a
  timeout, LOG_FAILED) leaves the keys of the calls before it done, as a retry that sends them again would find.
- Thread-safe (one request in flight at a time; threads take turns). A context manager.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from quillcache.cluster.client import Backoff
from quillcache.cluster.descriptors import DEFAULT_PREFIX
from quillcache.master.columns import PutColumns, ReplicaColumns, columns_from_rows, concat_columns
from quillcache.master.errors import InvalidParamsError, NotLeaderError
from quillcache.master.types import (MasterStats, ObjectInfo, PinKind, PutRequest, PutStartResult, ReplicaConfig,
                                     ReplicaDescriptor, SegmentDescriptor, TickReport)
from quillcache.master.wire import (BATCH_METHODS, MAX_BATCH_KEYS, NODE_METHODS, SERVICE_METHODS, WRITE_METHODS,
                                    decode_batch, decode_columns, decode_sizes, encode_sizes, expand_put_results,
                                    expand_replicas, put_rows, register_master_types)
from quillcache.master.errors import MasterError
from quillcache.rpc import InProcessClient, RpcClient, RpcErrorCode, RpcRejectedError, RpcTimeoutError
from quillcache.rpc.stream import is_stream_address

__all__ = ["MasterClient", "STREAM_RETRY_AFTER_S"]

# After the plain-TCP transport failed (or turned the client away), calls go over ZeroMQ this long before the
# client moves back to the same stream address: a saturated stream port costs one failed try per period, not
# one per call.
STREAM_RETRY_AFTER_S = 10.0


class MasterClient:
    """See the module docstring."""

    def __init__(self, address: str | Sequence[str] | None = None, *, etcd: str | None = None, name: str = "master",
                 prefix: str = DEFAULT_PREFIX, timeout_s: float = 5.0, retry_s: float = 30.0,
                 retry_writes: bool = False, backoff: Backoff = Backoff(initial_s=0.05, max_s=1.0),
                 prefer_stream: bool = True, _rpc=None) -> None:
        register_master_types()
        self.timeout_s = float(timeout_s)
        self._zmq_rpc = None  # the ZeroMQ client to fall back to while on the plain-TCP transport
        self._probe_stream = False
        self._stream_down: tuple[str, float] | None = None  # (stream address that failed, monotonic retry time)
        self.retry_s = float(retry_s)
        self.retry_writes = bool(retry_writes)
        self.backoff = backoff
        self._etcd = None
        self._leader_key = None
        self._bad_record: str | None = None  # why the election key named no leader the last time it was read
        self._compact = True  # False once a server answered that it does not serve the compact forms
        self._columns = True  # the same for the columnar forms
        if _rpc is not None:
            self._rpc = _rpc
            return
        finder = None
        if etcd is not None:
            from quillcache.cluster.client import EtcdClient
            from quillcache.cluster.descriptors import election_key

            self._etcd = EtcdClient(etcd, connect_timeout_s=min(10.0, self.retry_s))
            self._leader_key = election_key(name, prefix)
            finder = self._find_leader
            if address is None:
                address = self._wait_for_leader()
        if address is None or (not isinstance(address, str) and not list(address)):
            raise ValueError("MasterClient needs an address, a list of addresses, or etcd=")
        self._rpc = self._rpc_client(address, finder)
        self._probe_stream = (prefer_stream and etcd is None and isinstance(address, str)
                              and not is_stream_address(address))

    def _rpc_client(self, address, finder=None, *, found_stream: bool = False) -> RpcClient:
        # a plain-TCP address learnt from a ZeroMQ server: a refused connection falls back to ZeroMQ at once
        return RpcClient(address, self.timeout_s, leader_finder=finder, retry_codes={"NOT_LEADER"}, max_retries=3,
                         backoff_s=self.backoff.initial_s, max_backoff_s=self.backoff.max_s,
                         stream_reconnect=not found_stream)

    def _find_stream(self) -> None:
        """Ask the (ZeroMQ) server where its plain-TCP transport listens and move there when it serves one."""
        try:
            status = self._rpc.call("master_status")
        except RpcRejectedError as e:
            if e.code != RpcErrorCode.UNKNOWN_METHOD:
                raise
            status = None
        self._probe_stream = False
        address = status.get("stream_address") if isinstance(status, dict) else None
        down = self._stream_down
        if down is not None and (address != down[0] or time.monotonic() >= down[1]):
            self._stream_down = down = None  # another stream address (a restart), or the wait is over
        if down is None and isinstance(address, str) and is_stream_address(address):
            self._zmq_rpc, self._rpc = self._rpc, self._rpc_client(address, found_stream=True)

    def _lost_stream(self) -> None:
        """The plain-TCP server did not answer or turned us away: back to ZeroMQ, which is asked for the stream
        address at once (a restarted server may listen on another stream port); the same address is tried again
        after ``STREAM_RETRY_AFTER_S``."""
        if self._zmq_rpc is not None:
            self._stream_down = (self._rpc.address, time.monotonic() + STREAM_RETRY_AFTER_S)
            self._rpc.close()
            self._rpc, self._zmq_rpc = self._zmq_rpc, None
            self._probe_stream = True

    @classmethod
    def embedded(cls, service) -> MasterClient:
        """The same API on an in-process ``MasterService`` (no sockets); calls are serialised by a lock."""
        from quillcache.master.server import MasterEndpoint, SingleMaster

        endpoint = MasterEndpoint(SingleMaster(service))
        return cls(_rpc=InProcessClient(endpoint, [*SERVICE_METHODS, *NODE_METHODS]))

    # ------------------------------------------------------------------ leader discovery
    def _find_leader(self) -> str | None:
        from quillcache.cluster.descriptors import LeaderInfo

        from quillcache.cluster.descriptors import DescriptorError

        kv = self._etcd.get(self._leader_key)  # type: ignore[union-attr]
        if kv is None:
            return None
        try:
            return LeaderInfo.decode(kv.value, kv.create_revision).address
        except DescriptorError as e:  # not a leader record: no leader to go to (the election clears such a key)
            self._bad_record = f"{self._leader_key} on etcd {self._etcd.endpoint} holds no leader record ({e})"
            return None

    def _wait_for_leader(self) -> str:
        deadline = time.monotonic() + self.retry_s
        delays = self.backoff.delays()
        while True:
            found = self._find_leader()
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise NotLeaderError(self._bad_record or f"no master leads {self._leader_key} on etcd "
                                     f"{self._etcd.endpoint} (waited {self.retry_s} s)")
            time.sleep(next(delays))

    @property
    def address(self) -> str | None:
        return getattr(self._rpc, "address", None)

    # ------------------------------------------------------------------ calls
    def call(self, method: str, *args, **kwargs):
        """Call ``method`` with the retries of the module docstring."""
        resend_on_timeout = method not in WRITE_METHODS or self.retry_writes
        deadline = time.monotonic() + self.retry_s
        delays = self.backoff.delays()
        fell_back = False
        while True:
            try:
                if self._probe_stream or (self._stream_down is not None
                                          and time.monotonic() >= self._stream_down[1]):
                    self._find_stream()
                out = self._rpc.call(method, *args, **kwargs)
                return decode_batch(out) if method in BATCH_METHODS else out
            except NotLeaderError:
                if time.monotonic() >= deadline:
                    raise
            except RpcRejectedError as e:
                if e.code is not RpcErrorCode.TOO_MANY_CONNECTIONS:
                    raise
                on_stream = self._zmq_rpc is not None
                self._lost_stream()
                if on_stream:
                    continue  # turned away, so not run: at once over ZeroMQ
                if time.monotonic() >= deadline:
                    raise
            except RpcTimeoutError as e:
                on_stream = self._zmq_rpc is not None
                self._lost_stream()
                if on_stream and getattr(e, "sent", True) is False and not fell_back:
                    fell_back = True  # nothing was sent: at once over ZeroMQ, which asks for the new stream port
                    continue
                never_sent = getattr(e, "sent", True) is False  # (no connection: the call cannot have run)
                if not (resend_on_timeout or never_sent) or time.monotonic() >= deadline:
                    raise
            time.sleep(next(delays))

    def _call_compact(self, method: str, *args, **kwargs):
        """``method`` (a compact form), or None when the server does not serve the compact forms (the
        caller then uses the plain method)."""
        if self._compact:
            try:
                return self.call(method, *args, **kwargs)
            except RpcRejectedError as e:
                if e.code != RpcErrorCode.UNKNOWN_METHOD:
                    raise
                self._compact = False
        return None

    def _call_columns(self, method: str, *args, **kwargs):
        """``method`` (a columnar form), its reply rebuilt; None when the server does not serve it."""
        if self._columns:
            try:
                out = self.call(method, *args, **kwargs)
            except RpcRejectedError as e:
                if e.code != RpcErrorCode.UNKNOWN_METHOD:
                    raise
                self._columns = False
            else:
                return decode_columns(out, put=method == "batch_put_start_columns")
        return None

    def close(self) -> None:
        self._rpc.close()
        if self._zmq_rpc is not None:
            self._zmq_rpc.close()
        if self._etcd is not None:
            self._etcd.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MasterClient({self._rpc!r})"

    # ------------------------------------------------------------------ segments and clients
    def mount_segment(self, segment: SegmentDescriptor) -> None:
        return self.call("mount_segment", segment)

    def unmount_segment(self, segment_id: int, *, client_id: str | None = None) -> None:
        return self.call("unmount_segment", segment_id, client_id=client_id)

    def heartbeat(self, client_id: str) -> None:
        return self.call("heartbeat", client_id)

    # ------------------------------------------------------------------ puts
    def put_start(self, key: str, size_bytes: int, config: ReplicaConfig | None = None, *,
                  pin: PinKind = PinKind.NONE, digest: bytes | None = None,
                  client_id: str | None = None) -> PutStartResult:
        rows = put_rows([PutRequest(key=key, size_bytes=size_bytes, config=config or ReplicaConfig(), pin=pin,
                                    digest=digest)]) if config is None or type(config) is ReplicaConfig else None
        if rows is not None:
            out = self._call_compact("batch_put_start_compact", rows, client_id=client_id)
            if out is not None:
                res = expand_put_results(out[0], decode_batch(out[1]))[0]
                if isinstance(res, MasterError):
                    raise res
                return res
        return self.call("put_start", key, size_bytes, config, pin=pin, digest=digest, client_id=client_id)

    def batch_put_start(self, requests: Sequence[PutRequest], *,
                        client_id: str | None = None) -> list[PutStartResult | MasterError]:
        requests = list(requests)
        if len(requests) > MAX_BATCH_KEYS:
            return [r for part in _parts(requests) for r in self.batch_put_start(part, client_id=client_id)]
        rows = put_rows(requests)
        if rows is not None:
            out = self._call_compact("batch_put_start_compact", rows, client_id=client_id)
            if out is not None:
                return expand_put_results(out[0], decode_batch(out[1]))
        return self.call("batch_put_start", requests, client_id=client_id)

    def batch_put_start_returning(self, requests: Sequence[PutRequest], *,
                                  client_id: str | None = None) -> list[PutStartResult | MasterError]:
        """``MasterService.batch_put_start_returning`` on the master (copies coming back from a node's SSD tier)."""
        requests = list(requests)
        if len(requests) > MAX_BATCH_KEYS:
            return [r for part in _parts(requests)
                    for r in self.batch_put_start_returning(part, client_id=client_id)]
        return self.call("batch_put_start_returning", requests, client_id=client_id)

    def batch_put_start_columns(self, keys: Sequence[str], sizes: Sequence[int] | np.ndarray, *, replica_num: int = 1,
                                preferred_segment: int | None = None, pin: PinKind | int = PinKind.NONE,
                                digests: Sequence[bytes | None] | None = None,
                                client_id: str | None = None) -> PutColumns:
        """``MasterService.batch_put_start_columns`` on the master: ``batch_put_start`` of
        ``PutRequest(keys[i], sizes[i], ReplicaConfig(replica_num, preferred_segment), pin, digests[i])``
        for every i, as :class:`PutColumns` (``to_list()`` equals ``batch_put_start``'s value; per-key
        errors in ``errors``). ``sizes``: a NumPy integer array or a sequence of ints (sent as raw
        int64 bytes). A length mismatch or arguments of the wrong type raise InvalidParamsError for
        the whole call. A state change: not resent after a timeout unless ``retry_writes``."""
        keys = keys if isinstance(keys, (str, bytes)) else list(keys)
        if digests is not None and not isinstance(digests, (str, bytes)):
            digests = list(digests)
        if _splittable(keys, sizes, digests):
            return concat_columns([self.batch_put_start_columns(
                keys[sl], sizes[sl], replica_num=replica_num, preferred_segment=preferred_segment, pin=pin,
                digests=None if digests is None else digests[sl], client_id=client_id) for sl in _slices(keys)])
        wire_sizes = encode_sizes(sizes)
        out = self._call_columns("batch_put_start_columns", keys, wire_sizes, replica_num=replica_num,
                                 preferred_segment=preferred_segment, pin=pin, digests=digests, client_id=client_id)
        if out is not None:
            return out
        # a server without the columnar forms: the compact one, rebuilt into the same columns
        sizes = decode_sizes(wire_sizes)
        if isinstance(keys, (str, bytes)) or len(sizes) != len(keys) \
                or (digests is not None and (isinstance(digests, (str, bytes)) or len(digests) != len(keys))):
            raise InvalidParamsError(f"batch_put_start_columns: {_len(keys)} keys, {_len(sizes)} sizes and "
                                     f"{_len(digests)} digests do not match")
        pin_v = pin.value if type(pin) is PinKind else pin
        rows = [[k, s, replica_num, preferred_segment, pin_v, None if digests is None else digests[i]]
                for i, (k, s) in enumerate(zip(keys, sizes.tolist() if isinstance(sizes, np.ndarray) else sizes))]
        out = self.call("batch_put_start_compact", rows, client_id=client_id)
        return columns_from_rows(out[0], decode_batch(out[1]), put=True)

    def put_end(self, key: str, *, put_id: int | None = None) -> None:
        return self.call("put_end", key, put_id=put_id)

    def batch_put_end(self, keys: Sequence[str], *,
                      put_ids: Sequence[int | None] | None = None) -> list[None | MasterError]:
        keys, put_ids = list(keys), None if put_ids is None else list(put_ids)
        if _splittable(keys, put_ids):
            return [r for sl in _slices(keys)
                    for r in self.batch_put_end(keys[sl], put_ids=None if put_ids is None else put_ids[sl])]
        return self.call("batch_put_end", keys, put_ids=put_ids)

    def put_revoke(self, key: str, *, put_id: int | None = None) -> None:
        return self.call("put_revoke", key, put_id=put_id)

    def batch_put_revoke(self, keys: Sequence[str], *,
                         put_ids: Sequence[int | None] | None = None) -> list[None | MasterError]:
        keys, put_ids = list(keys), None if put_ids is None else list(put_ids)
        if _splittable(keys, put_ids):
            return [r for sl in _slices(keys)
                    for r in self.batch_put_revoke(keys[sl], put_ids=None if put_ids is None else put_ids[sl])]
        return self.call("batch_put_revoke", keys, put_ids=put_ids)

    # ------------------------------------------------------------------ reads
    def get_replicas(self, keys: Sequence[str]) -> list[tuple[ReplicaDescriptor, ...] | MasterError]:
        keys = list(keys)
        if len(keys) > MAX_BATCH_KEYS:
            return [r for part in _parts(keys) for r in self.get_replicas(part)]
        out = self._call_compact("get_replicas_compact", keys)
        if out is None:
            return self.call("get_replicas", keys)
        return expand_replicas(out[0], decode_batch(out[1]))

    def get_replicas_columns(self, keys: Sequence[str]) -> ReplicaColumns:
        """``MasterService.get_replicas_columns`` on the master: ``get_replicas(keys)`` as
        :class:`ReplicaColumns` (``to_list()`` equals its value); the same read leases. A read:
        resent after a timeout within ``retry_s``."""
        keys = keys if isinstance(keys, (str, bytes)) else list(keys)
        if _splittable(keys):
            return concat_columns([self.get_replicas_columns(part) for part in _parts(keys)])
        out = self._call_columns("get_replicas_columns", keys)
        if out is not None:
            return out
        out = self.call("get_replicas_compact", keys)
        return columns_from_rows(out[0], decode_batch(out[1]), put=False)

    def get_replica_list(self, key: str) -> tuple[ReplicaDescriptor, ...]:
        out = self._call_compact("get_replica_list_compact", key)
        if out is None:
            return self.call("get_replica_list", key)
        return expand_replicas(out[0], [out[1]])[0]

    def exists(self, keys: Sequence[str]) -> list[bool | MasterError]:
        keys = list(keys)
        if len(keys) > MAX_BATCH_KEYS:
            return [r for part in _parts(keys) for r in self.exists(part)]
        return self.call("exists", keys)

    def exist_key(self, key: str) -> bool:
        return self.call("exist_key", key)

    # ------------------------------------------------------------------ remove / evict / timers
    def remove(self, key: str, *, force: bool = False) -> None:
        return self.call("remove", key, force=force)

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[None | MasterError]:
        keys = list(keys)
        if len(keys) > MAX_BATCH_KEYS:
            return [r for part in _parts(keys) for r in self.batch_remove(part, force=force)]
        return self.call("batch_remove", keys, force=force)

    def evict(self, target_bytes: int | None = None) -> list[str]:
        return self.call("evict", target_bytes)

    def tick(self) -> TickReport:
        return self.call("tick")

    # ------------------------------------------------------------------ introspection
    def object_info(self, key: str) -> ObjectInfo:
        return self.call("object_info", key)

    def keys(self) -> list[str]:
        return self.call("keys")

    def segments(self) -> list[SegmentDescriptor]:
        return self.call("segments")

    def segment_usage(self, segment_id: int) -> tuple[int, int]:
        return self.call("segment_usage", segment_id)

    def clients(self) -> list[str]:
        return self.call("clients")

    def stats(self) -> MasterStats:
        return self.call("stats")

    def master_status(self) -> dict:
        """The server's role, epoch, lsn, leader address (answered by any role)."""
        return self.call("master_status")

    def snapshot_bytes(self) -> bytes:
        return self.call("snapshot_bytes")


def _slices(keys: list) -> list[slice]:
    """Consecutive slices of at most ``MAX_BATCH_KEYS`` covering ``keys``."""
    return [slice(i, i + MAX_BATCH_KEYS) for i in range(0, len(keys), MAX_BATCH_KEYS)]


def _parts(items: list) -> list[list]:
    return [items[sl] for sl in _slices(items)]


def _splittable(keys, *others) -> bool:
    """``keys`` is a list longer than one call may carry and each of ``others`` is None or as long (a batch
    whose lengths disagree is sent whole, for the master to refuse)."""
    return (type(keys) is list and len(keys) > MAX_BATCH_KEYS
            and all(o is None or (hasattr(o, "__getitem__") and not isinstance(o, (str, bytes))
                                  and len(o) == len(keys)) for o in others))


def _len(v) -> object:
    return "no" if v is None else len(v) if hasattr(v, "__len__") else type(v).__name__
