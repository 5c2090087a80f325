"""``LeaseKeeper``: one etcd lease kept alive by a background thread, with a local deadline.

Contract:
- ``grant()`` creates the lease (``ttl_s`` as etcd granted it: etcd raises TTLs below about 2 s) and
  starts a thread that refreshes it every ``granted_ttl_s / 3``.
- ``deadline_s`` (``time.monotonic`` seconds) is the send time of the last refresh etcd confirmed plus
  the granted TTL: etcd cannot have expired the lease before it, and the holder must assume it has
  after it. ``alive()`` is ``now < deadline_s`` and no loss seen; a paused (SIGSTOPped) process that
  resumes past its deadline sees ``alive() == False`` before its first refresh.
- A failed refresh (etcd unreachable) is retried at shorter intervals with one warning line per
  streak; the lease is lost when etcd says it expired (TTL ≤ 0) or when the deadline passes without a
  confirmed refresh. Then ``on_lost(reason)`` is called once, from the keeper's thread, and the thread
  ends (the owner decides whether to grant a new lease).
- ``stop(revoke=True)`` ends the thread and revokes the lease (its keys go at once); ``stop(revoke=False)``
  abandons it (its keys go when it expires, as when the process dies). Both are idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from quillcache._checks import check_int
from quillcache.cluster.client import EtcdClient, EtcdError, EtcdUnavailableError

__all__ = ["LeaseKeeper"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Keeps one lease alive (see the module contract)."""

    def __init__(self, client: EtcdClient, ttl_s: int, *, on_lost: Callable[[str], None] | None = None,
                 name: str = "lease", clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.ttl_s = check_int("ttl_s", ttl_s, 1)
        self.name = name
        self._on_lost = on_lost
        self._clock = clock
        self.lease_id = 0
        self.granted_ttl_s = 0
        self.deadline_s = float("-inf")
        self.lost_reason: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def grant(self) -> int:
        """Create the lease and start keeping it alive; the lease id."""
        if self.lease_id:
            raise RuntimeError(f"{self.name}: lease {self.lease_id:x} was already granted")
        sent = self._clock()
        self.lease_id, self.granted_ttl_s = self.client.grant(self.ttl_s)
        self.deadline_s = sent + self.granted_ttl_s
        self._thread = threading.Thread(target=self._run, name=f"etcd-lease {self.name}", daemon=True)
        self._thread.start()
        return self.lease_id

    def alive(self) -> bool:
        return self.lost_reason is None and self.lease_id != 0 and self._clock() < self.deadline_s

    def _run(self) -> None:
        period_s = self.granted_ttl_s / 3
        retry_s = max(0.1, self.granted_ttl_s / 10)
        failing = False
        wait_s = period_s
        while not self._stop.wait(wait_s):
            sent = self._clock()
            if sent >= self.deadline_s:
                self._lose(f"no refresh of lease {self.lease_id:x} confirmed by etcd at {self.client.endpoint} "
                           f"within its {self.granted_ttl_s} s TTL")
                return
            try:
                ttl = self.client.refresh(self.lease_id)
            except (EtcdUnavailableError, EtcdError) as e:
                if not failing:
                    log.warning("%s: keep-alive failed (%s); retrying every %.1f s until the lease deadline",
                                self.name, e, retry_s)
                failing = True
                wait_s = min(retry_s, max(0.0, self.deadline_s - self._clock()))
                continue
            if ttl <= 0:
                self._lose(f"etcd at {self.client.endpoint} says lease {self.lease_id:x} has expired")
                return
            if failing:
                log.warning("%s: keep-alive works again", self.name)
            failing = False
            self.deadline_s = sent + ttl
            wait_s = period_s

    def _lose(self, reason: str) -> None:
        if self._stop.is_set() or self.lost_reason is not None:
            return
        self.lost_reason = reason
        log.warning("%s: %s", self.name, reason)
        if self._on_lost is not None:
            try:
                self._on_lost(reason)
            except Exception:
                log.exception("%s: on_lost callback raised", self.name)

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join()
        if revoke and self.lease_id and self.lost_reason is None:
            try:
                self.client.revoke(self.lease_id)
            except EtcdError as e:  # it expires by itself; nothing to undo
                log.warning("%s: could not revoke lease %x (%s); it will expire", self.name, self.lease_id, e)
        self.lost_reason = self.lost_reason or "stopped"
