"""``EtcdClient``: the etcd v3 calls the cluster layer needs, over etcd's HTTP/JSON gateway (``etcd3gw``).

Why this client: Debian's ``etcd-server`` 3.4 serves the v3 gRPC gateway at ``/v3`` (``/v3beta`` too;
``/v3alpha`` is gone), which ``etcd3gw`` finds through ``/version``; it is synchronous and pure Python
(requests), so the registry's and the election's background threads call it directly, with no event
loop and no grpcio/protobuf pins. Unary calls go through ``etcd3gw``; watches are our own stream
(``quillcache.cluster.watch``), because etcd3gw's watcher splits the stream on HTTP chunks, drops the
errors of its thread and never reconnects.

Contract:
- Construction checks that etcd answers (``/version``). For ``connect_timeout_s`` (10 s by default; 0: one
  try) an unreachable etcd is retried with exponential backoff (``Backoff``), one warning line per attempt naming the
  endpoint; when the window closes, ``EtcdUnavailableError`` names the endpoint, the attempts and the
  last cause. Nothing is printed as a traceback and nothing loops forever.
- Every call that cannot reach etcd raises ``EtcdUnavailableError`` (a ``ConnectionError``) naming the
  endpoint and the call; every other failure reported by etcd raises ``EtcdError`` with etcd's message.
- Keys are ``str`` (UTF-8), values ``bytes``; revisions and lease ids are ``int``.
- One ``etcd3gw`` client per thread (``requests.Session`` is not shared between threads). ``close()``
  closes every thread's connections (a later call opens a new one).
"""

from __future__ import annotations

import base64
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import etcd3gw
from etcd3gw import exceptions as gw_errors

from quillcache._checks import check_float

__all__ = ["Backoff", "EtcdClient", "EtcdError", "EtcdUnavailableError", "KeyValue", "TxnResult",
           "compare_create", "compare_lease", "compare_value", "delete_op", "parse_endpoint", "prefix_end",
           "put_op", "range_op"]

log = logging.getLogger(__name__)


class EtcdError(Exception):
    """etcd answered with an error (the message is etcd's)."""


class EtcdUnavailableError(EtcdError, ConnectionError):
    """etcd could not be reached; ``endpoint`` names where we looked."""

    def __init__(self, message: str, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Exponential backoff: ``initial_s``, times ``factor`` per attempt, at most ``max_s``."""

    initial_s: float = 0.1
    max_s: float = 2.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        check_float("initial_s", self.initial_s, 0.0, lo_open=True)
        check_float("max_s", self.max_s, self.initial_s)
        check_float("factor", self.factor, 1.0)

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield delay
            delay = min(self.max_s, delay * self.factor)


_HOST_RE = re.compile(r"^(?:[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])$")  # a name, IPv4, or a bracketed IPv6 address


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (an ``http://`` prefix allowed) → ``(host, port)``; ValueError naming a bad one: another
    scheme (the client speaks plain HTTP to etcd's JSON gateway), a list (one endpoint), a host that is not a name
    or an address, a port that is not ASCII digits in [1, 65535]."""
    if not isinstance(endpoint, str):
        raise TypeError(f"etcd endpoint must be a 'host:port' str, got {type(endpoint).__name__} {endpoint!r}")
    if "," in endpoint:
        raise ValueError(f"etcd endpoint {endpoint!r} is a list: give one 'host:port'")
    rest = endpoint.removeprefix("http://").rstrip("/")
    if "://" in rest:
        raise ValueError(f"etcd endpoint {endpoint!r}: only plain http:// is spoken to etcd")
    host, sep, port = rest.rpartition(":")
    if not sep or not _HOST_RE.match(host) or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint {endpoint!r} is not 'host:port' with a host name or address and a port in "
                         f"[1, 65535]")
    return host.strip("[]"), int(port)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix`` (its last byte plus one)."""
    raw = bytearray(prefix.encode())
    assert raw and raw[-1] < 0x7F, prefix
    raw[-1] += 1
    return raw.decode()


# -- transaction pieces (the gateway's JSON) --------------------------------------------------------------
def compare_create(key: str, revision: int, result: str = "EQUAL") -> dict[str, Any]:
    """Compare ``key``'s create revision (0: the key does not exist)."""
    return {"key": _b64(key), "result": result, "target": "CREATE", "create_revision": revision}


def compare_value(key: str, value: bytes, result: str = "EQUAL") -> dict[str, Any]:
    return {"key": _b64(key), "result": result, "target": "VALUE", "value": _b64(value)}


def compare_lease(key: str, lease_id: int, result: str = "EQUAL") -> dict[str, Any]:
    return {"key": _b64(key), "result": result, "target": "LEASE", "lease": lease_id}


def put_op(key: str, value: bytes, lease_id: int | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease_id:
        op["lease"] = lease_id
    return {"request_put": op}


def range_op(key: str) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key)}}


def delete_op(key: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it; ``lease`` is 0 when the key has none."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(key=base64.b64decode(kv["key"]).decode(errors="replace"),
                   value=base64.b64decode(kv.get("value", "")),
                   create_revision=int(kv.get("create_revision", 0)), mod_revision=int(kv.get("mod_revision", 0)),
                   version=int(kv.get("version", 0)), lease=int(kv.get("lease", 0)))


@dataclass(frozen=True, slots=True)
class TxnResult:
    """``succeeded``: which branch ran; ``revision``: the store's revision after the txn;
    ``responses``: the branch's responses (range responses' key-values in ``ranges``)."""

    succeeded: bool
    revision: int
    ranges: tuple[tuple[KeyValue, ...], ...]


class EtcdClient:
    """A connection to one etcd endpoint (see the module contract)."""

    def __init__(self, endpoint: str = "127.0.0.1:2379", *, request_timeout_s: float = 2.0,
                 connect_timeout_s: float = 10.0, backoff: Backoff = Backoff()) -> None:
        self.host, self.port = parse_endpoint(endpoint)
        self.endpoint = f"{self.host}:{self.port}"
        self.request_timeout_s = check_float("request_timeout_s", request_timeout_s, 0.0, lo_open=True)
        check_float("connect_timeout_s", connect_timeout_s, 0.0)
        self.backoff = backoff
        self._local = threading.local()
        self._sessions: weakref.WeakSet[etcd3gw.Etcd3Client] = weakref.WeakSet()  # every thread's, for close()
        self._sessions_lock = threading.Lock()
        self.version, self.api_path = self._connect(connect_timeout_s)

    # -- connecting --------------------------------------------------------------------------------
    def _connect(self, timeout_s: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout_s
        delays = self.backoff.delays()
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._discover()
            except EtcdUnavailableError as e:
                cause = str(e)
            delay = next(delays)
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdUnavailableError(
                    f"etcd at {self.endpoint} is not reachable ({attempt} attempt(s) over {timeout_s:g} s; last: "
                    f"{cause}); start etcd there or point the cluster at another endpoint", self.endpoint)
            log.warning("etcd at %s is not reachable (attempt %d: %s); retrying in %.2f s",
                        self.endpoint, attempt, cause, min(delay, left))
            time.sleep(min(delay, left))  # backoff between attempts, bounded by the connect deadline

    def _discover(self) -> tuple[str, str]:
        probe = etcd3gw.client(host=self.host, port=self.port, timeout=self.request_timeout_s)
        try:
            path = self._guard("version check", lambda: probe.api_path)
            version = probe.session.get(probe.base_url + "/version", timeout=self.request_timeout_s).json()
        except (OSError, ValueError) as e:  # requests' errors are OSErrors; a non-JSON answer a ValueError
            raise EtcdUnavailableError(f"etcd at {self.endpoint}: {type(e).__name__}: {e}", self.endpoint) from None
        finally:
            probe.session.close()
        return str(version.get("etcdserver", "?")), path

    def _gw(self) -> etcd3gw.Etcd3Client:
        gw = getattr(self._local, "gw", None)
        if gw is None:
            gw = self._local.gw = etcd3gw.client(host=self.host, port=self.port, timeout=self.request_timeout_s,
                                                 api_path=getattr(self, "api_path", None))
            with self._sessions_lock:
                self._sessions.add(gw)
        return gw

    def _guard(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (gw_errors.ConnectionFailedError, gw_errors.ConnectionTimeoutError) as e:
            detail = e.detail_text or (e.args[0] if e.args else type(e).__name__)
            raise EtcdUnavailableError(f"etcd at {self.endpoint} unreachable during {what}: {detail}",
                                       self.endpoint) from None
        except gw_errors.Etcd3Exception as e:
            raise EtcdError(f"etcd at {self.endpoint} refused {what}: {e.detail_text or e}") from None

    def _post(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        gw = self._gw()
        return self._guard(what, lambda: gw.post(gw.get_url(path), json=payload))

    # -- keys ---------------------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        result = self._post("/kv/range", {"key": _b64(key)}, f"get {key!r}")
        kvs = result.get("kvs", [])
        return KeyValue.from_json(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key) and the revision they were read at."""
        result = self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))},
                            f"list {prefix!r}")
        return [KeyValue.from_json(kv) for kv in result.get("kvs", [])], int(result["header"]["revision"])

    def put(self, key: str, value: bytes, lease_id: int | None = None) -> int:
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease_id:
            payload["lease"] = lease_id
        return int(self._post("/kv/put", payload, f"put {key!r}")["header"]["revision"])

    def delete(self, key: str) -> bool:
        result = self._post("/kv/deleterange", {"key": _b64(key)}, f"delete {key!r}")
        return int(result.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        result = self._post("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))},
                            f"delete prefix {prefix!r}")
        return int(result.get("deleted", 0))

    def txn(self, compare: Sequence[dict], success: Sequence[dict], failure: Sequence[dict] = (), *,
            what: str = "txn") -> TxnResult:
        result = self._post("/kv/txn", {"compare": list(compare), "success": list(success),
                                        "failure": list(failure)}, what)
        ranges = tuple(tuple(KeyValue.from_json(kv) for kv in r["response_range"].get("kvs", []))
                       for r in result.get("responses", []) if "response_range" in r)
        return TxnResult(succeeded=bool(result.get("succeeded", False)),  # JSON leaves a false out
                         revision=int(result["header"]["revision"]), ranges=ranges)

    def compact(self, revision: int) -> None:
        self._post("/kv/compaction", {"revision": revision, "physical": True}, f"compact to {revision}")

    # -- leases -------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: ``(lease_id, granted_ttl_s)`` (etcd raises a TTL below its minimum, about 2 s)."""
        result = self._post("/lease/grant", {"TTL": int(ttl_s), "ID": 0}, f"lease grant ttl={ttl_s}")
        if result.get("error"):
            raise EtcdError(f"etcd at {self.endpoint} refused lease grant: {result['error']}")
        return int(result["ID"]), int(result["TTL"])

    def refresh(self, lease_id: int) -> int:
        """One keep-alive: the lease's new TTL in seconds, or ≤ 0 when it has expired (or never existed)."""
        result = self._post("/lease/keepalive", {"ID": lease_id}, f"keep-alive of lease {lease_id:x}")
        return int(result.get("result", {}).get("TTL", -1))

    def revoke(self, lease_id: int) -> bool:
        """Revoke (its keys are deleted at once); False when the lease was already gone."""
        try:
            self._post("/kv/lease/revoke", {"ID": lease_id}, f"revoke of lease {lease_id:x}")
        except EtcdUnavailableError:
            raise
        except EtcdError as e:
            if "lease not found" in str(e):
                return False
            raise
        return True

    def close(self) -> None:
        """Close the connections of every thread that used this client (a later call reconnects)."""
        self._local.gw = None
        with self._sessions_lock:
            sessions = list(self._sessions)
        for gw in sessions:
            gw.session.close()

    def __repr__(self) -> str:
        return f"EtcdClient({self.endpoint!r}, etcd {self.version})"
