"""``LeaderElection`` through one etcd key, and ``EpochFence`` that keeps a deposed leader's writes out.

The design is Mooncake's master election (REFERENCE §9):
- **Campaign**: each candidate holds a lease of ``ttl_s`` (kept alive by ``LeaseKeeper``) and tries
  ``txn(If create_revision(key) == 0, Then put(key, {candidate, address}, lease), Else range(key))``.
  The winner's **epoch** is that key's create revision (unique and increasing in etcd, so a fencing
  token). A loser watches the key from the revision it read and tries again when the key is deleted
  (resigned, or its holder's lease expired).
- **Lease hygiene**: a round campaigns only with a lease whose keeper is ``alive()`` (no loss seen and
  its local deadline not passed: the deadline can pass before the keeper's thread notices). A lease
  that fails that check (also at the end of the warm-up: the won key goes with it), that etcd answers
  "lease not found" for, or that holds the key from an earlier round, is revoked (so its key goes at
  once) and replaced by a new one; a candidate never waits for its own key to go and keeps campaigning.
- **A deposed leader yields**: a candidate that lost leadership waits one TTL before its next round, so
  a standby that was watching the key takes the seat. The leader that lost its lease is the suspect one
  (paused, partitioned, starved); racing the standbys for the key it just lost would hand the seat
  back to it. When no other candidate exists, the seat stays empty one TTL longer.
- **Warm-up**: after winning, the candidate keeps its lease alive for ``warmup_s`` (one TTL by default)
  before it reports leadership, then checks the key is still its own: by then an old leader that is
  alive has seen its own lease deadline pass (see ``LeaseKeeper``) and stepped down. So a SIGKILLed
  leader is replaced after its lease runs out (at most one TTL after its last refresh, plus etcd's
  0.5 s expiry check) and the warm-up: at most 2×TTL + 0.5 s, the key itself changes hands within TTL + 0.5 s.
- **Leadership** lasts while the lease is alive and the key is the one it wrote: ``is_leader`` checks
  the lease's local deadline on every call (so a process resumed after a pause past its deadline is not
  leader even before its keep-alive thread runs); losing the lease or the key (deleted, re-created, or
  overwritten: another value, or no longer held by this candidate's lease), or ``step_down(epoch)`` (a
  write of that epoch was fenced), calls ``on_lost(reason)`` once. ``resign()`` deletes the key (only if
  it is still ours) and revokes the lease.
- **Foreign keys**: a candidate writes the key only with its lease, so a key with no lease (a plain put by an
  operator tool or a buggy client, even over a leader's key) is never a candidate's: a candidate that finds
  one logs a WARNING naming the key, its value and the endpoint, and deletes it (only while it still has
  that create revision and no lease), then campaigns. A key that has a lease is never deleted by another
  candidate: one whose value does not decode is reported in one WARNING (key, endpoint) and goes with its
  lease (etcd deletes a key with its lease), like any holder's.
- **Resigning ends every campaign**: ``resign()`` cancels and then waits for every ``campaign()`` running
  when it was called (on any thread, not only ``start()``'s), then stops whatever lease keeper and key
  monitor they left, so no lease of a resigned candidate is kept alive and its key goes at once. A
  campaign that sees the cancel does not campaign on (checked after a lease grant and before the txn).
- **One monitor per leadership**: the watch on the won key lives while that epoch leads; stepping down
  cancels it, and an event for an epoch that no longer leads is ignored.
- **A standby does not trust its watch alone**: besides the key's delete event it re-reads the key
  every TTL (a watch stream that died without a FIN/RST delivers nothing), and campaigns when the key
  is gone or was re-created by someone else.
- **Fencing**: ``EpochFence`` guards writes with ``txn(If create_revision(key) == epoch and value(key)
  == our record, Then <writes>)`` so an old leader that was paused (SIGSTOP) across an election and
  resumed commits nothing: the new leader's key has another create revision. ``FencedError`` names
  both epochs.
- etcd unreachable while campaigning: retries with backoff (a warning per attempt naming the endpoint)
  until ``campaign``'s timeout, then ``EtcdUnavailableError``; never a traceback loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from quillcache._checks import check_float, check_int
from quillcache.cluster.client import (Backoff, EtcdClient, EtcdError, EtcdUnavailableError, KeyValue, TxnResult,
                                       compare_create, compare_lease, compare_value, delete_op, put_op,
                                       range_op)
from quillcache.cluster.descriptors import DEFAULT_PREFIX, DescriptorError, LeaderInfo, check_endpoint, election_key
from quillcache.cluster.lease import LeaseKeeper
from quillcache.cluster.watch import Watch, WatchEvent

__all__ = ["EpochFence", "FencedError", "LeaderElection", "NotLeaderError"]

log = logging.getLogger(__name__)


class FencedError(RuntimeError):
    """A write refused because the writer's epoch is no longer the leader key's."""

    def __init__(self, message: str, epoch: int, current: LeaderInfo | None) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.current = current


class NotLeaderError(RuntimeError):
    """An operation that needs leadership, asked of a candidate that does not hold it."""


def _current(kvs: tuple) -> LeaderInfo | None:
    if not kvs:
        return None
    kv = kvs[0]
    try:
        return LeaderInfo.decode(kv.value, kv.create_revision)
    except DescriptorError:
        return LeaderInfo(candidate_id=f"<undecodable {kv.value[:32]!r}>", address="?:0", epoch=kv.create_revision)


class EpochFence:
    """Writes that commit only while ``epoch`` is still the leader key's (see the module docstring)."""

    def __init__(self, client: EtcdClient, key: str, epoch: int, candidate_id: str, address: str) -> None:
        self.client = client
        self.key = key
        self.epoch = check_int("epoch", epoch, 1)
        self.candidate_id = candidate_id
        self._record = LeaderInfo.encode(candidate_id, address)

    def compares(self) -> list[dict]:
        """The txn compares that hold only while this epoch leads (to add to any txn)."""
        return [compare_create(self.key, self.epoch), compare_value(self.key, self._record)]

    def _refused(self, current: LeaderInfo | None, what: str) -> FencedError:
        now = "no leader" if current is None else f"epoch {current.epoch} held by {current.candidate_id!r}"
        return FencedError(f"{what} refused: written with epoch {self.epoch} of {self.candidate_id!r}, but "
                           f"{self.key} now has {now}", self.epoch, current)

    def txn(self, success: Sequence[dict], compare: Sequence[dict] = (), failure: Sequence[dict] = (), *,
            what: str = "fenced write") -> TxnResult:
        """``success`` if the fence and ``compare`` hold; FencedError if the fence does not, else the
        result (``succeeded=False``: a compare of the caller's failed; ``ranges[0]`` is the leader key)."""
        res = self.client.txn([*self.compares(), *compare], success, [range_op(self.key), *failure], what=what)
        if not res.succeeded:
            current = _current(res.ranges[0]) if res.ranges else None
            kv = res.ranges[0][0] if res.ranges and res.ranges[0] else None
            if kv is None or kv.create_revision != self.epoch or kv.value != self._record:
                raise self._refused(current, what)
        return res

    def check(self) -> None:
        """FencedError unless this epoch still leads (a linearizable read through a txn)."""
        self.txn([], what="epoch check")

    def put(self, key: str, value: bytes) -> int:
        """Put ``key`` only while this epoch leads; the revision written."""
        return self.txn([put_op(key, value)], what=f"put {key!r}").revision

    def delete(self, key: str) -> None:
        self.txn([delete_op(key)], what=f"delete {key!r}")


class LeaderElection:
    """One candidate of election ``name`` (see the module docstring)."""

    def __init__(self, etcd: EtcdClient | str, name: str, candidate_id: str, address: str, ttl_s: int = 5, *,
                 prefix: str = DEFAULT_PREFIX, warmup_s: float | None = None,
                 on_elected: Callable[[int], None] | None = None, on_lost: Callable[[str], None] | None = None,
                 connect_timeout_s: float = 10.0, backoff: Backoff = Backoff()) -> None:
        self.key = election_key(name, prefix)
        if not isinstance(candidate_id, str) or not candidate_id:
            raise ValueError(f"candidate_id must be a non-empty str, got {candidate_id!r}")
        self._owns_client = not isinstance(etcd, EtcdClient)  # an endpoint: resign() closes the client made here
        self.client = etcd if isinstance(etcd, EtcdClient) else \
            EtcdClient(etcd, connect_timeout_s=connect_timeout_s, backoff=backoff)
        self.name = name
        self.candidate_id = candidate_id
        self.address = check_endpoint(address, "address")
        self.ttl_s = check_int("ttl_s", ttl_s, 1)
        self.warmup_s = None if warmup_s is None else check_float("warmup_s", warmup_s, 0.0)
        self.on_elected = on_elected
        self.on_lost = on_lost
        self._backoff = backoff
        self._record = LeaderInfo.encode(candidate_id, self.address)
        self._keeper: LeaseKeeper | None = None
        self._epoch: int | None = None
        self._epoch_lease = 0               # the lease that holds the key of ``_epoch``
        self._leader = False
        self._wake = threading.Event()      # a change worth re-checking: key deleted, lease lost, resign
        self._cancel = threading.Event()    # resign()/close(): stop campaigning
        self._lock = threading.RLock()
        self._yield_until = 0.0             # monotonic time before which a deposed leader does not campaign
        self._monitor: Watch | None = None
        self._thread: threading.Thread | None = None
        self._campaigns: set[threading.Thread] = set()  # threads inside campaign(): resign() waits for them
        self._warned: tuple[int, int] | None = None  # (create, mod revision) of the undecodable key last reported

    # -- state ----------------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        keeper = self._keeper
        return self._leader and keeper is not None and keeper.alive()

    @property
    def epoch(self) -> int | None:
        """The epoch while leader, else None."""
        return self._epoch if self.is_leader else None

    def leader(self) -> LeaderInfo | None:
        """Who leads now, as etcd says (candidate, address, epoch); None when nobody does."""
        kv = self.client.get(self.key)
        return None if kv is None else _current((kv,))

    def fence(self) -> EpochFence:
        """The fence of this candidate's current epoch; NotLeaderError when it does not lead."""
        epoch = self.epoch
        if epoch is None:
            raise NotLeaderError(f"{self.candidate_id!r} does not lead election {self.name!r}")
        return EpochFence(self.client, self.key, epoch, self.candidate_id, self.address)

    # -- campaigning ------------------------------------------------------------------------------------
    def _on_lease_lost(self, reason: str) -> None:
        self._wake.set()
        self._step_down(f"lease lost: {reason}")

    def _step_down(self, reason: str) -> None:
        with self._lock:
            was = self._leader
            self._leader = False
            if was:
                self._yield_until = time.monotonic() + self.ttl_s
            monitor, self._monitor = self._monitor, None
        if monitor is not None:  # the key's watch serves one leadership (cancel works from its own thread too)
            monitor.cancel()
        if was:
            log.warning("election %r: %r is no longer leader (epoch %s): %s", self.name, self.candidate_id,
                        self._epoch, reason)
            if self.on_lost is not None:
                try:
                    self.on_lost(reason)
                except Exception:
                    log.exception("election %r: on_lost callback raised", self.name)

    def _drop_lease(self, why: str) -> None:
        """Give up the current lease: revoke it first (the key it holds goes at once, even while the
        keeper's thread is still waiting on a late keep-alive answer), then stop its keeper."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        log.warning("election %r: %r drops lease %x (%s) and campaigns with a new one", self.name,
                    self.candidate_id, keeper.lease_id, why)
        try:
            self.client.revoke(keeper.lease_id)
        except EtcdError as e:  # unreachable: the lease (and its key) expires by itself
            log.warning("election %r: could not revoke lease %x (%s); it will expire", self.name,
                        keeper.lease_id, e)
        keeper.stop(revoke=False)

    def _ensure_lease(self, deadline: float) -> int:
        """The lease to campaign with: the current one only while its keeper is alive (no loss seen AND
        its local deadline not passed: a deadline can pass before the keeper's thread notices), else a
        new one (the old one is revoked first)."""
        delays = self._backoff.delays()
        while True:
            keeper = self._keeper
            if keeper is not None and keeper.alive():
                return keeper.lease_id
            if keeper is not None:
                self._drop_lease(keeper.lost_reason or "its local deadline passed without a confirmed refresh")
            keeper = LeaseKeeper(self.client, self.ttl_s, on_lost=self._on_lease_lost,
                                 name=f"election {self.name} ({self.candidate_id})")
            try:
                keeper.grant()
            except EtcdUnavailableError as e:
                delay = next(delays)
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("election %r: %s; retrying in %.1f s", self.name, e, delay)
                if self._cancel.wait(delay):
                    raise NotLeaderError(f"campaign of {self.candidate_id!r} was cancelled") from None
                continue
            with self._lock:
                cancelled = self._cancel.is_set()
                if not cancelled:
                    self._keeper = keeper
            if cancelled:  # resign() ran during the grant: this lease must not outlive the campaign
                keeper.stop(revoke=True)
                raise NotLeaderError(f"campaign of {self.candidate_id!r} was cancelled")
            return keeper.lease_id

    def campaign(self, timeout_s: float | None = None) -> int:
        """Block until this candidate leads (after the warm-up); its epoch. TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + (float("inf") if timeout_s is None else
                                       check_float("timeout_s", timeout_s, 0.0))
        me = threading.current_thread()
        with self._lock:  # atomic with resign()'s cancel: it either waits for this campaign or ran before it
            self._cancel.clear()
            self._campaigns.add(me)
        try:
            return self._campaign(deadline, timeout_s)
        finally:
            with self._lock:
                self._campaigns.discard(me)

    def _campaign(self, deadline: float, timeout_s: float | None) -> int:
        delays = self._backoff.delays()
        while True:
            if self._cancel.is_set():
                raise NotLeaderError(f"campaign of {self.candidate_id!r} was cancelled")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.candidate_id!r} did not win election {self.name!r} in {timeout_s} s")
            yield_s = self._yield_until - time.monotonic()
            if yield_s > 0:  # deposed: the standbys get the first try
                self._cancel.wait(min(yield_s, max(0.0, deadline - time.monotonic())))
                continue
            try:
                epoch = self._try_once(deadline)
            except EtcdUnavailableError as e:
                delay = next(delays)
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("election %r: %s; retrying in %.1f s", self.name, e, delay)
                self._cancel.wait(delay)
                continue
            except EtcdError as e:
                if "lease not found" not in str(e):
                    raise
                self._drop_lease(f"etcd no longer knows it: {e}")  # expired behind the keeper's back
                continue
            if epoch is not None:
                if self.on_elected is not None:
                    self.on_elected(epoch)
                return epoch

    def _try_once(self, deadline: float) -> int | None:
        """One round: win (and warm up) → epoch; lose → wait for the key to go → None."""
        lease = self._ensure_lease(deadline)
        self._wake.clear()
        if self._cancel.is_set():  # resign() is waiting for this campaign: do not take the key now
            return None
        res = self.client.txn([compare_create(self.key, 0)], [put_op(self.key, self._record, lease)],
                              [range_op(self.key)], what=f"campaign for {self.key}")
        if not res.succeeded:
            holder = res.ranges[0][0] if res.ranges and res.ranges[0] else None
            if holder is not None and holder.lease == lease:  # our own key of an earlier round: never wait on it
                self._drop_lease(f"the key {self.key} still held by it is from an earlier round")
            elif holder is not None and holder.lease == 0:  # no candidate's (module docstring): remove it
                self._delete_foreign(holder)
            elif holder is not None:
                self._warn_undecodable(holder)
                self._wait_for_delete(res.revision + 1, holder.create_revision, deadline)
            return None
        epoch = res.revision  # the put ran in this txn: the key's create revision
        log.info("election %r: %r won epoch %d; warming up", self.name, self.candidate_id, epoch)
        warmup_s = self._keeper.granted_ttl_s if self.warmup_s is None else self.warmup_s  # type: ignore[union-attr]
        if self._cancel.wait(warmup_s):
            return None
        if self._keeper is None or not self._keeper.alive():  # the won key must not outlive this round
            self._drop_lease("it was not confirmed alive at the end of the warm-up")
            return None
        kv = self.client.get(self.key)
        if kv is None or kv.create_revision != epoch or kv.lease != lease:
            return None
        with self._lock:
            if self._cancel.is_set():  # resigned during the warm-up: resign() revokes the lease
                return None
            self._epoch, self._leader, self._epoch_lease = epoch, True, lease
            self._monitor = Watch(self.client, self.key, lambda ev: self._on_key_event(ev, epoch),
                                  start_revision=kv.mod_revision + 1, name=f"election {self.name} leader")
        log.info("election %r: %r leads with epoch %d", self.name, self.candidate_id, epoch)
        return epoch

    def _wait_for_delete(self, from_revision: int, holder_epoch: int, deadline: float) -> None:
        """Until the key held at ``holder_epoch`` is deleted (its watch event, or a re-read of the key every
        TTL finds it gone or re-created: a watch stream can die silently), a wake, cancel or ``deadline``."""
        gone = threading.Event()

        def on_event(ev: WatchEvent) -> None:
            if ev.kind == "delete" or ev.kv.lease == 0:  # deleted, or overwritten by a plain put: foreign now
                gone.set()
                self._wake.set()

        with Watch(self.client, self.key, on_event, start_revision=from_revision,
                   on_compacted=lambda _rev: self._wake.set(), name=f"election {self.name} standby"):
            next_read = time.monotonic() + self.ttl_s
            while not gone.is_set() and not self._cancel.is_set():
                if self._wake.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                    return
                if time.monotonic() >= deadline:
                    return
                if time.monotonic() >= next_read:
                    next_read = time.monotonic() + self.ttl_s
                    try:
                        kv = self.client.get(self.key)
                    except EtcdError as e:  # etcd unreachable: the watch (or the next read) tells
                        log.debug("election %r: re-reading %s: %s", self.name, self.key, e)
                        continue
                    if kv is None or kv.create_revision != holder_epoch or kv.lease == 0:
                        return

    def _warn_undecodable(self, holder: KeyValue) -> None:
        """One WARNING per version of a held key whose value is not a leader record (it goes with its lease)."""
        try:
            LeaderInfo.decode(holder.value, holder.create_revision)
        except DescriptorError as e:
            if self._warned != (holder.create_revision, holder.mod_revision):
                self._warned = (holder.create_revision, holder.mod_revision)
                log.warning("election %r: the election key %s at etcd %s holds %r, not a leader record (%s); "
                            "it is held by lease %x, so %r waits for it to go with that lease (delete the key to "
                            "end the wait)", self.name, self.key, self.client.endpoint, holder.value[:64], e,
                            holder.lease, self.candidate_id)

    def _delete_foreign(self, holder: KeyValue) -> None:
        """Delete a key that has no lease (never a candidate's), only while it still has none."""
        log.warning("election %r: the election key %s at etcd %s holds %r with no lease (written by something "
                    "other than a candidate, which always writes it with its lease); %r deletes it and campaigns",
                    self.name, self.key, self.client.endpoint, holder.value[:64], self.candidate_id)
        self.client.txn([compare_create(self.key, holder.create_revision), compare_lease(self.key, 0)],
                        [delete_op(self.key)], what=f"delete foreign {self.key}")

    def _on_key_event(self, ev: WatchEvent, epoch: int) -> None:
        if self._epoch != epoch:  # a late event of an earlier leadership's monitor
            return
        if ev.kind == "delete":
            self._step_down(f"leader key {self.key} was deleted at revision {ev.revision}")
        elif ev.kv.create_revision != epoch:
            self._step_down(f"leader key {self.key} was re-created at revision {ev.kv.create_revision}")
        elif ev.kv.value != self._record or ev.kv.lease != self._epoch_lease:
            self._step_down(f"leader key {self.key} was overwritten at revision {ev.revision} with {ev.kv.value[:64]!r}"
                            f" (lease {ev.kv.lease:x}, its own {self._epoch_lease:x})")

    def step_down(self, epoch: int, reason: str) -> None:
        """Stop leading ``epoch`` (if it still does: a write of that epoch was fenced, so its key is no longer what
        this candidate wrote, even when the watch on it missed the change); its campaign goes on."""
        if self._leader and self._epoch == epoch:
            self._step_down(reason)

    def start(self) -> None:
        """Campaign in a background thread (``on_elected(epoch)`` when it wins); ``resign()`` ends it."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"{self.candidate_id!r} is already campaigning")

        def run() -> None:
            try:
                self.campaign()
            except NotLeaderError:
                pass
            except (EtcdError, TimeoutError) as e:
                log.error("election %r: campaign of %r stopped: %s", self.name, self.candidate_id, e)

        self._thread = threading.Thread(target=run, name=f"election {self.name} ({self.candidate_id})", daemon=True)
        self._thread.start()

    # -- leaving ------------------------------------------------------------------------------------------
    def resign(self) -> None:
        """Stop campaigning (waiting for every campaign running now, on any thread); if leader, delete the key
        (only if still ours); revoke the lease; close the client when it was made from an endpoint here."""
        with self._lock:
            self._cancel.set()
            running = set(self._campaigns)
        self._wake.set()
        if self._thread is not None:
            running.add(self._thread)
        for thread in running:
            if thread is not threading.current_thread():
                thread.join()
        self._thread = None
        with self._lock:
            epoch, was_leader = self._epoch, self._leader
            self._leader = False
            monitor, self._monitor = self._monitor, None
            keeper, self._keeper = self._keeper, None
        if monitor is not None:
            monitor.cancel()
        try:
            if was_leader and epoch is not None:
                self.client.txn([compare_create(self.key, epoch)], [delete_op(self.key)],
                                what=f"resign {self.key}")
        except EtcdError as e:
            log.warning("election %r: resign could not delete %s (%s); it goes with the lease", self.name,
                        self.key, e)
        finally:
            if keeper is not None:
                keeper.stop(revoke=True)
            if self._owns_client:
                self.client.close()

    close = resign

    def __enter__(self) -> LeaderElection:
        return self

    def __exit__(self, *exc) -> None:
        self.resign()
