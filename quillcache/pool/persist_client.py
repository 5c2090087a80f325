"""``PersistClient``: a pool client's write-behind requests to nodes (``persist``) and their confirmation
(``flush_persist``), mixed into :class:`~quillcache.pool.store.PooledStore`.

A put with ``persist=True`` queues, per node control address, ``(key, offset, size, put_id)`` items; one
background thread sends them (``persist_chunks``: calls a node accepts) and never on a put's critical path.
What a flush reports, and when an address is asked, kept, reported once or dropped, is ``flush_persist``'s
docstring. Invariants: every persist a node accepted stays counted for its control address, with the boot id of
the process it went to, until a flush confirms it (that process answered), or reports it never confirmed durable
(the node restarted there, or the master no longer holds it there); flushes run one at a time.

The host class provides ``master``, ``_closed``, ``_count(**stats)``, ``_control_key``, ``_segments`` /
``_seg_lock`` (endpoint -> (engine segment, control address, node id, regions)), ``_ctl_failed`` and ``_no_ssd``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from quillcache.master.types import MAX_KEY_CHARS
from quillcache.pool.control_auth import sign as sign_control
from quillcache.pool.errors import NoSsdTierError
from quillcache.pool.writebehind import MAX_PERSIST_ITEMS

__all__ = ["PersistClient", "persist_chunks"]

log = logging.getLogger("quillcache.pool.store")  # the store's lines, under the store's logger


def persist_chunks(items: list) -> list[list]:
    """``items`` (``(key, offset, size, put_id)``) cut into the calls a node accepts: at most ``MAX_PERSIST_ITEMS``
    items and at most ``MAX_PERSIST_ITEMS * MAX_KEY_CHARS`` key bytes (UTF-8) each, so every call fits the node's
    control frame whatever the keys' characters (``quillcache.pool.node.CONTROL_MAX_FRAME_BYTES``)."""
    budget = MAX_PERSIST_ITEMS * MAX_KEY_CHARS
    out: list[list] = []
    cur: list = []
    used = 0
    for it in items:
        n = len(it[0].encode("utf-8", "surrogatepass"))
        if cur and (len(cur) == MAX_PERSIST_ITEMS or used + n > budget):
            out.append(cur)
            cur, used = [], 0
        cur.append(it)
        used += n
    if cur:
        out.append(cur)
    return out


class PersistClient:
    """The persist / flush half of a pool client (module docstring)."""

    def _init_persist(self) -> None:
        self._persist_q: collections.deque = collections.deque()
        self._persist_cv = threading.Condition()
        self._persist_busy = False
        # control address -> RpcClient, closed once a flush_persist confirms or drops the address (by the persist
        # thread when it was busy then: _persist_retire)
        self._persist_clients: dict[str, object] = {}
        self._persist_retire: set[str] = set()
        # control address -> (persists sent, node id, transfer endpoint, boot id of the process they went to)
        self._persist_unconfirmed: dict[str, tuple[int, str | None, str | None, str | None]] = {}
        self._flush_lock = threading.Lock()  # one flush_persist at a time (each settles what it snapshotted)
        self._persist_boot: dict[str, str | None] = {}  # control address -> boot id of the process persisted to
        self._persist_lost: dict[str, tuple[int, str]] = {}  # control address -> (persists never sent, first cause)
        self._persist_thread: threading.Thread | None = None

    def _stop_persist(self) -> None:
        """Wake the persist thread (the host is closed) and wait for it to send what is queued."""
        with self._persist_cv:
            self._persist_cv.notify_all()
        if self._persist_thread is not None:
            self._persist_thread.join(timeout=10)

    def _close_persist_clients(self) -> None:
        for c in self._persist_clients.values():
            c.close()

    def _queue_persist(self, by_node: dict[str, list]) -> None:
        with self._persist_cv:
            self._persist_q.append(by_node)
            if self._persist_thread is None:
                self._persist_thread = threading.Thread(target=self._persist_loop, name="pool-persist", daemon=True)
                self._persist_thread.start()
            self._persist_cv.notify()

    def _persist_loop(self) -> None:
        from quillcache.rpc import RpcClient

        while True:
            with self._persist_cv:
                for ctl in self._persist_retire:  # dropped by a flush_persist that ran while this thread was busy
                    c = self._persist_clients.pop(ctl, None)
                    if c is not None:
                        c.close()
                self._persist_retire.clear()
                while not self._persist_q and not self._closed:
                    self._persist_busy = False
                    self._persist_cv.notify_all()
                    self._persist_cv.wait()
                if self._closed and not self._persist_q:
                    self._persist_busy = False
                    self._persist_cv.notify_all()
                    return
                self._persist_busy = True
                merged: dict[str, list] = {}
                while self._persist_q:
                    for ctl, items in self._persist_q.popleft().items():
                        merged.setdefault(ctl, []).extend(items)
            for ctl, items in merged.items():
                if ctl in self._no_ssd:
                    self._count(persist_no_ssd=len(items))
                    continue
                sent = 0
                try:
                    c = self._persist_clients.get(ctl)
                    if c is None:
                        c = self._persist_clients[ctl] = RpcClient(ctl, timeout_s=2.0)
                    boot = self._persist_boot.get(ctl)  # which process the persists go to: a flush answered by
                    if boot is None:  # another one (the node restarted there) confirms none of them
                        boot = c.call("info").get("boot_id")
                        with self._persist_cv:
                            self._persist_boot[ctl] = boot
                    for chunk in persist_chunks(items):  # a node refuses a longer call whole
                        c.call("persist", chunk, auth=self._control_proof("persist", chunk))
                        sent += len(chunk)
                        self._count(persist_sent=len(chunk))
                except NoSsdTierError as e:  # nothing can be durable there: not sent again, flush_persist says so
                    self._no_ssd[ctl] = str(e)
                    self._count(persist_no_ssd=len(items) - sent)
                except Exception as e:
                    lost = len(items) - sent  # the calls the node accepted are its own business now
                    log.info("persist to %s failed: %s", ctl, e)
                    self._count(persist_errors=lost)
                    with self._persist_cv:  # the next flush_persist reports them for this node
                        n, why = self._persist_lost.get(ctl, (0, f"{type(e).__name__}: {e}"))
                        self._persist_lost[ctl] = (n + lost, why)
                    c = self._persist_clients.pop(ctl, None)
                    if c is not None:
                        c.close()
                if sent:  # accepted by the node: unconfirmed until a flush_persist asks it
                    with self._seg_lock:
                        where = next(((got[2], ep) for ep, got in self._segments.items() if got[1] == ctl), None)
                    with self._persist_cv:  # the entry keeps the process its first unconfirmed persist went to
                        n, node, endpoint, first = self._persist_unconfirmed.get(ctl, (0, None, None, boot))
                        self._persist_unconfirmed[ctl] = (n + sent, *(where or (node, endpoint)), first)

    def _control_proof(self, method: str, args: object) -> list | None:
        """A node's proof for a control call (``quillcache.pool.control_auth``); None on the local backend."""
        return None if self._control_key is None else sign_control(self._control_key, method, args)

    def flush_persist(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Wait until every queued persist was sent, then ask each node holding persists of this store that no
        flush confirmed yet to make them durable (``flush``). The nodes are asked all at once, each until the
        deadline (``timeout_s`` after the call): one that does not answer costs this flush at most ``timeout_s``
        and never shortens another's wait. Returns, by control address, a node's info (every persist sent to it
        before this call is durable) or ``{"error": why}`` (with ``"node_id"`` where known) naming how many persists
        are not confirmed durable. Reported here:

        - every address sent persists since its last confirmed flush. It stays in every report until a flush
          confirms it (its info comes back from the process the persists went to: then it is not asked again until
          it is sent new persists; an answer from another process, the node restarted on the same ports, reports
          them never confirmed durable and forgets them, as the node's ``boot_id`` tells) or until the
          master holds no segment of its node at the transfer endpoint the persists went through (the node
          stopped, was dropped at its client TTL, or restarted on other ports): that flush reports it once more,
          saying its persists were never confirmed durable, and forgets it. Until then an error keeps it: no
          answer by the deadline, a failed flush (``PersistFailedError``: some persist sent to it is not durable),
          or failed transfers (it is not asked until this store reaches the node again);
        - once, an address that a persist since the previous flush could not be sent to (those blocks were
          dropped: no flush can make them durable);
        - once, a node without an SSD tier (it refused a persist with ``NoSsdTierError``; until this report, later
          persists to it are counted in ``persist_no_ssd``, not sent; after it, the next one is sent again, so a
          node restarted with an SSD tier gets them).

        An address no longer reported has its persist client closed. Concurrent calls run one after the other
        (a call waiting longer than its ``timeout_s`` for another raises ``TimeoutError``)."""
        deadline = time.monotonic() + timeout_s
        if not self._flush_lock.acquire(timeout=max(0.0, timeout_s)):
            raise TimeoutError(f"flush_persist: another flush_persist of this store ran past {timeout_s} s")
        try:
            return self._flush_persist(deadline, timeout_s)
        finally:
            self._flush_lock.release()

    def _flush_persist(self, deadline: float, timeout_s: float) -> dict[str, dict]:
        from quillcache.rpc import RpcClient, RpcConnectionError, RpcTimeoutError

        with self._persist_cv:
            while self._persist_q or self._persist_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"persist queue not drained within {timeout_s} s")
                self._persist_cv.wait(left)
            lost, self._persist_lost = self._persist_lost, {}
            sent = dict(self._persist_unconfirmed)
        no_ssd = {ctl: self._no_ssd.pop(ctl) for ctl in list(self._no_ssd)}  # reported once, then sent again
        with self._seg_lock:  # a node whose transfers failed is asked again once this store reached it since
            self._ctl_failed -= {got[1] for got in self._segments.values()}
            skip = self._ctl_failed & set(sent)
        ask = sorted(set(sent) - skip)
        answers: dict[str, object] = {}  # control address, or "" for the master's segments -> reply or exception
        answered = threading.Condition()

        def run(name: str, call: Callable[[], object]) -> None:
            try:
                reply = call()
            except Exception as e:
                reply = e
            with answered:
                answers[name] = reply
                answered.notify_all()

        def flush_one(ctl: str) -> object:
            with RpcClient(ctl, timeout_s=max(0.1, deadline - time.monotonic())) as c:
                return c.call("flush", auth=self._control_proof("flush", []))

        def gone(ctl: str, segs: object) -> bool:  # the master holds no segment of the node where its persists went
            _, node, endpoint, _ = sent[ctl]
            return isinstance(segs, frozenset) and node is not None and (node, endpoint) not in segs

        def silent(ctl: str) -> bool:
            return (ctl in skip or ctl not in answers
                    or isinstance(answers[ctl], (RpcTimeoutError, RpcConnectionError)))

        calls = [(ctl, lambda ctl=ctl: flush_one(ctl)) for ctl in ask]
        if any(v[1] is not None for v in sent.values()):
            calls.append(("", lambda: frozenset((s.node_id, s.endpoint) for s in self.master.segments())))
        for name, call in calls:
            threading.Thread(target=run, args=(name, call), name="pool-flush", daemon=True).start()
        with answered:  # until every node answered or is gone, and the master said which of the silent ones are
            while deadline > time.monotonic():
                if not ([c for c in ask if c not in answers and not gone(c, answers.get(""))]
                        or (len(calls) > len(ask) and "" not in answers and any(map(silent, sent)))):
                    break
                answered.wait(deadline - time.monotonic())
            got = dict(answers)
        segs = got.get("")
        out: dict[str, dict] = {}
        done: dict[str, int] = {}  # control address -> persists confirmed durable or never to be
        restarted: set[str] = set()  # answered by another process than the one persisted to
        for ctl in sorted(set(sent) | set(lost) | set(no_ssd)):
            why = []
            if ctl in lost:
                why.append(f"{lost[ctl][0]} persist(s) could not be sent to the node: {lost[ctl][1]}")
            if ctl in no_ssd:
                why.append(f"no SSD tier: persists are not sent to it ({no_ssd[ctl]})")
            n, node, endpoint, boot = sent.get(ctl, (0, None, None, None))
            reply = got.get(ctl)
            if n and isinstance(reply, dict) and boot is not None \
                    and reply.get("boot_id") != boot:  # another process answered: the node restarted there
                done[ctl] = n
                restarted.add(ctl)
                why.append(f"the node restarted since they were sent: {n} persist(s) sent to its earlier process "
                           f"were never confirmed durable")
            elif n and reply is not None and not isinstance(reply, Exception):
                done[ctl] = n
            elif n:
                if ctl in skip:
                    why.append("the node's transfers failed; not asked")
                elif reply is not None:
                    why.append(f"{type(reply).__name__}: {reply}")
                elif not gone(ctl, segs):
                    why.append(f"no answer to flush within {timeout_s} s")
                if gone(ctl, segs):
                    done[ctl] = n
                    why.append(f"node {node!r} is gone from {endpoint} (the master holds no segment of it there): "
                               f"{n} persist(s) sent to it were never confirmed durable; it is not asked again")
                else:
                    why.append(f"{n} persist(s) sent to it are not confirmed durable")
            out[ctl] = reply if not why else {"error": "; ".join(why), **({"node_id": node} if node else {})}
        with self._persist_cv:
            for ctl in restarted:  # the next persist there asks which process it reaches
                if self._persist_boot.get(ctl) == sent[ctl][3]:
                    del self._persist_boot[ctl]
            for ctl, n in done.items():
                cur = self._persist_unconfirmed.pop(ctl, (0, None, None, None))
                if cur[0] > n:  # sent while this flush ran: the next one asks
                    self._persist_unconfirmed[ctl] = (cur[0] - n, *cur[1:])
            retire = {ctl for ctl in out if ctl not in self._persist_unconfirmed}
            for ctl in retire:  # nothing unconfirmed there: the next persist asks again which process it reaches
                self._persist_boot.pop(ctl, None)
            if self._persist_busy:
                self._persist_retire |= retire
            else:
                for ctl in retire:
                    c = self._persist_clients.pop(ctl, None)
                    if c is not None:
                        c.close()
        with self._seg_lock:
            self._ctl_failed -= retire
        return out
