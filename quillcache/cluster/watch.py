"""``Watch``: one etcd watch (a key or a prefix) delivered to a callback, that survives etcd restarts.

Contract:
- Events arrive in revision order, each once, through ``on_event(event)`` called from the watch's own
  thread. The watch starts at ``start_revision`` (None: from now) and after a broken stream resumes at
  the revision after the last one delivered, so a restarted etcd loses no event (as long as it has not
  compacted them).
- When etcd has compacted the revisions the watch still needed, ``on_compacted(compact_revision)`` is
  called (the caller re-reads the state it follows) and the watch is re-opened at once: after the
  revision ``on_compacted`` returns (the one the caller read its state at, so no change between that
  read and the new stream is lost), or from the present when it returns None or there is none. etcd
  cancels such a watch but leaves its stream open, so the stream is always ended here, never read on.
- A stream that breaks is re-opened with backoff; each failure logs one warning naming the endpoint.
  An idle stream has no read timeout, but TCP keep-alive probes it (``KEEPALIVE_IDLE_S`` idle, then
  ``KEEPALIVE_COUNT`` unanswered probes ``KEEPALIVE_INTERVAL_S`` apart, where the platform allows): a flow
  that died without a FIN/RST (a peer gone, a dropped NAT entry) breaks within about 10 s and is re-opened.
  An exception raised by a callback is logged with its traceback and the watch goes on.
- ``cancel()`` stops the thread (it shuts the stream's socket to interrupt a blocked read) and waits
  for it; after ``cancel()`` returns no callback runs. It is idempotent; the watch is a context manager.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from quillcache.cluster.client import Backoff, EtcdClient, KeyValue, prefix_end

__all__ = ["Watch", "WatchEvent"]

log = logging.getLogger(__name__)

KEEPALIVE_IDLE_S = 4       # idle seconds before the first keep-alive probe
KEEPALIVE_INTERVAL_S = 2   # seconds between unanswered probes
KEEPALIVE_COUNT = 3        # unanswered probes before the kernel drops the flow (the read raises OSError)


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle stream so a dead flow ends the read (the kernel default waits about two hours)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        opt = getattr(socket, name, None)
        if opt is not None:  # Linux, recent macOS; elsewhere the system's keep-alive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class _Reopen(Exception):
    """etcd canceled the watch (a compaction) but keeps its stream open: end it and open a new one."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """``kind`` is ``"put"`` or ``"delete"``; ``prev`` the key's previous value where etcd sent it."""

    kind: str
    key: str
    kv: KeyValue
    prev: KeyValue | None
    revision: int


class Watch:
    """Watch ``key`` (every key under it with ``prefix=True``) and call ``on_event`` for each change."""

    def __init__(self, client: EtcdClient, key: str, on_event: Callable[[WatchEvent], None], *,
                 prefix: bool = False, start_revision: int | None = None,
                 on_compacted: Callable[[int], int | None] | None = None, backoff: Backoff = Backoff(),
                 name: str = "") -> None:
        self._client = client
        self._key = key
        self._range_end = prefix_end(key) if prefix else None
        self._on_event = on_event
        self._on_compacted = on_compacted
        self._backoff = backoff
        self._next_revision = start_revision  # the first revision not yet delivered
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.created = threading.Event()  # set once etcd has confirmed the (first) watch
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {name or key}", daemon=True)
        self._thread.start()

    # -- the stream ----------------------------------------------------------------------------------
    def _request(self) -> bytes:
        create: dict = {"key": base64.b64encode(self._key.encode()).decode(), "prev_kv": True}
        if self._range_end is not None:
            create["range_end"] = base64.b64encode(self._range_end.encode()).decode()
        if self._next_revision is not None:
            create["start_revision"] = self._next_revision
        return json.dumps({"create_request": create}).encode()

    def _run(self) -> None:
        delays = self._backoff.delays()
        while not self._stop.is_set():
            try:
                if self._stream():
                    delays = self._backoff.delays()  # it worked for a while: the next failure starts over
                    continue
                reason = "etcd closed the stream"
            except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
                reason = f"{type(e).__name__}: {e}"
            if self._stop.is_set():
                return
            delay = next(delays)
            log.warning("watch of %r at etcd %s broke (%s); reconnecting in %.1f s from revision %s",
                        self._key, self._client.endpoint, reason, delay, self._next_revision)
            self._stop.wait(delay)

    def _stream(self) -> bool:
        """Read one watch stream until it ends; True when it delivered (or was confirmed) before ending."""
        conn = http.client.HTTPConnection(self._client.host, self._client.port,
                                          timeout=self._client.request_timeout_s)
        try:
            conn.request("POST", self._client.api_path.rstrip("/") + "/watch", body=self._request(),
                         headers={"Content-Type": "application/json"})
            with self._lock:
                if self._stop.is_set():
                    return False
                self._sock = conn.sock
            resp = conn.getresponse()
            if resp.status != 200:
                raise ValueError(f"watch answered HTTP {resp.status}: {resp.read(200)!r}")
            conn.sock.settimeout(None)  # an idle watch is silent; cancel() shuts the socket
            _keep_alive(conn.sock)  # ... and keep-alive ends one whose flow died silently
            confirmed = False
            while not self._stop.is_set():
                line = resp.readline()
                if not line:
                    return confirmed
                if not line.strip():
                    continue
                message = json.loads(line)
                if "error" in message:
                    raise ValueError(f"watch error {message['error']}")
                try:
                    confirmed |= self._handle(message["result"])
                except _Reopen:
                    return True  # at once, from ``_next_revision``: nothing more comes on this stream
            return confirmed
        finally:
            with self._lock:
                self._sock = None
            conn.close()

    def _handle(self, result: dict) -> bool:
        if result.get("created"):
            if self._next_revision is None:  # "from now": pin it, so a reconnect resumes here
                self._next_revision = int(result["header"]["revision"]) + 1
            self.created.set()
            return True
        if int(result.get("compact_revision", 0)) > 0:
            compacted = int(result["compact_revision"])
            log.warning("watch of %r at etcd %s: revisions before %d were compacted; re-reading the state",
                        self._key, self._client.endpoint, compacted)
            self._next_revision = None
            if self._on_compacted is not None and not self._stop.is_set():
                read_at = self._call(self._on_compacted, compacted)
                if isinstance(read_at, int) and not isinstance(read_at, bool) and read_at >= compacted:
                    self._next_revision = read_at + 1
            raise _Reopen
        if result.get("canceled"):
            raise ValueError(f"etcd canceled the watch: {result.get('cancel_reason', 'no reason given')}")
        for ev in result.get("events", []):
            kv = KeyValue.from_json(ev["kv"])
            prev = KeyValue.from_json(ev["prev_kv"]) if "prev_kv" in ev else None
            kind = "delete" if ev.get("type") == "DELETE" else "put"
            if self._stop.is_set():
                return True
            self._call(self._on_event, WatchEvent(kind=kind, key=kv.key, kv=kv, prev=prev,
                                                  revision=kv.mod_revision))
            self._next_revision = kv.mod_revision + 1
        return True

    def _call(self, fn: Callable, arg: object) -> object:
        try:
            return fn(arg)
        except Exception:  # a callback's bug must not end the watch
            log.exception("watch callback for %r raised; the watch goes on", self._key)
            return None

    # -- stopping ------------------------------------------------------------------------------------
    def cancel(self) -> None:
        self._stop.set()
        with self._lock:
            sock = self._sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()
