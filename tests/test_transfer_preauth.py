"""The tcp backend's server against peers that do not know the secret: they cannot starve those that do.

What it shows (review defect "transfer engine pre-auth exhaustion"):

- An attacker thread keeps every pre-auth slot of a real server on 127.0.0.1 taken (silent
  connections, each re-opened as soon as the server drops it); meanwhile fresh authenticated clients
  open the segment and complete READs and WRITEs with exact bytes, each round well within its
  deadline. The server holds at most ``max_preauth_connections`` unauthenticated connections and
  spends no thread on any of them.
- The flood of dropped connections leaves a bounded log: the first ``DROP_LOG_BURST`` of each window
  one by one, then one summary line per window; every drop is either logged or counted in a summary
  (``stats.drop_logs_suppressed``).
- All authenticated slots taken: a new client is answered BUSY, tries again, and is served once a slot
  frees; one whose deadline passes first ends TIMEOUT naming the server's reason.
- A cap that is not a positive int is refused, naming the field.
- A BUSY retry cut short by the deadline still names the server's reason (``tcp_client.retry_busy``).

Servers are closed in ``finally`` (context managers); waits are polls with deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import re
import selectors
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from polling import wait_until

from quillcache.transfer import Op, Outcome, TcpConfig, TransferEngine, TransferError, TransferRequest
from quillcache.transfer.backends import acceptor
from quillcache.transfer.backends.tcp_client import retry_busy

SECRET = "quillcache-transfer-tests-secret-0123456789"
SERVER_LOG = "quillcache.transfer.server"
REGION_BYTES = 1 << 16


def _poll(predicate, timeout_s: float, what: str, interval_s: float = 0.002) -> None:
    wait_until(predicate, timeout_s, what, poll_s=interval_s)


class _Attacker(threading.Thread):
    """Keeps ``target`` connections to ``address`` open without ever sending a byte (it has no secret), and
    re-opens each one as soon as the server drops it."""

    def __init__(self, address: str, target: int) -> None:
        super().__init__(name="preauth-attacker", daemon=True)
        host, _, port = address.rpartition(":")
        self.addr, self.target = (host, int(port)), target
        self.opened = 0
        self.stop = threading.Event()

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        conns: set[socket.socket] = set()
        try:
            while not self.stop.is_set():
                while len(conns) < self.target and not self.stop.is_set():
                    try:
                        s = socket.create_connection(self.addr, timeout=1)
                    except OSError:
                        break
                    s.setblocking(False)
                    sel.register(s, selectors.EVENT_READ)
                    conns.add(s)
                    self.opened += 1
                for key, _ in sel.select(0.01):
                    s = key.fileobj
                    try:
                        data = s.recv(4096)  # the challenge, a BUSY answer, or EOF once the server dropped us
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        conns.discard(s)
                        s.close()
        finally:
            for s in conns:
                s.close()
            sel.close()


@contextlib.contextmanager
def _attack(address: str, target: int):
    attacker = _Attacker(address, target)
    attacker.start()
    try:
        yield attacker
    finally:
        attacker.stop.set()
        attacker.join(10)
        assert not attacker.is_alive(), "the attacker thread did not stop"


def _conn_threads() -> int:
    return sum(t.name.startswith("qc-transfer-conn") for t in threading.enumerate())


def _read_then_write(client, address: str, rdesc, served: np.ndarray, rng, timeout_s: float, r: int):
    """One round of a fresh client against ``served`` (``rdesc``) at ``address``: open the segment, READ a random
    range and WRITE 4096 fresh bytes at its start, each checked to the byte. Returns (local, ldesc, seg, off)."""
    local = np.zeros(REGION_BYTES, dtype=np.uint8)
    ldesc = client.register_region(local)
    seg = client.open_segment(address, timeout_s=timeout_s)
    off, n = int(rng.integers(0, REGION_BYTES // 2)), int(rng.integers(1, REGION_BYTES // 2))
    client.read(ldesc, 0, seg, rdesc.region_id, off, n, timeout_s=timeout_s)
    assert local[:n].tobytes() == served[off:off + n].tobytes(), f"round {r}: READ bytes differ"
    local[:4096] = rng.integers(0, 256, 4096, dtype=np.uint8)
    (st,) = client.transfer_sync([TransferRequest(Op.WRITE, ldesc.region_id, 0, seg.segment_id, rdesc.region_id, off,
                                                  4096)], timeout_s=timeout_s)
    assert st.outcome is Outcome.COMPLETED, f"round {r}, WRITE: {st}"
    assert served[off:off + 4096].tobytes() == local[:4096].tobytes(), f"round {r}: WRITE did not land"
    return local, ldesc, seg, off


def test_silent_connections_cannot_starve_authenticated_clients():
    preauth, rounds, round_deadline_s = 16, 6, 5.0
    config = TcpConfig(max_preauth_connections=preauth, max_server_connections=8, auth_timeout_s=0.5)
    rng = np.random.default_rng(2026)
    served = rng.integers(0, 256, REGION_BYTES, dtype=np.uint8)
    threads0 = _conn_threads()  # another test's server may still be letting its threads go
    with TransferEngine("tcp", secret=SECRET, config=config) as server:
        srv = server.backend.server
        rdesc = server.register_region(served)
        with _attack(server.address, target=8 * preauth) as attacker:
            # the flood under way: every pre-auth slot taken, and dropped connections opened again (twice over)
            _poll(lambda: srv.preauth_connections() == preauth and attacker.opened >= 16 * preauth, 10,
                  "the attacker taking every pre-auth slot")
            for r in range(rounds):
                # a round takes a few ms, less than the attacker may take to open again what the server dropped:
                # start it only once the attacker holds every slot again, so the client has to take one from it
                _poll(lambda: srv.preauth_connections() == preauth, 10, f"round {r}: the attacker refilling the slots")
                evicted_before = srv.stats.preauth_evicted
                t0 = time.monotonic()
                with TransferEngine("tcp", secret=SECRET, serve=False,
                                    config=TcpConfig(connections_per_peer=2)) as client:  # fresh connections
                    local, ldesc, seg, off = _read_then_write(client, server.address, rdesc, served, rng,
                                                              round_deadline_s, r)
                    back = TransferRequest(Op.READ, ldesc.region_id, 8192, seg.segment_id, rdesc.region_id, off, 4096)
                    (st,) = client.transfer_sync([back], timeout_s=round_deadline_s)
                    assert st.outcome is Outcome.COMPLETED, f"round {r}, read-back: {st}"
                    assert local[8192:8192 + 4096].tobytes() == local[:4096].tobytes(), f"round {r}: read-back differs"
                    busy_retries = client.backend.client.stats.busy_retries
                took = time.monotonic() - t0
                assert took < round_deadline_s, f"round {r} took {took:.2f} s ({busy_retries} BUSY retries)"
                # the attack went on throughout, and no unauthenticated connection held a thread or a slot past the cap
                assert srv.stats.preauth_evicted > evicted_before, f"round {r}: the attack paused"
                assert srv.preauth_connections() <= preauth
                assert _conn_threads() - threads0 <= srv.stats.authenticated
            assert attacker.opened > srv.stats.authenticated + 10 * preauth
        assert srv.stats.authenticated >= rounds and srv.stats.refused_busy == 0, srv.stats
    _poll(lambda: _conn_threads() <= threads0, 10, "the closed server's connection threads ending")


def test_a_flood_of_dropped_connections_leaves_a_bounded_log(caplog, monkeypatch):
    window_s, floods = 0.3, 2000
    monkeypatch.setattr(acceptor, "DROP_LOG_WINDOW_S", window_s)  # read when the server is built
    caplog.set_level(logging.WARNING, logger=SERVER_LOG)
    config = TcpConfig(max_preauth_connections=4, auth_timeout_s=0.2)
    t0 = time.monotonic()
    with TransferEngine("tcp", secret=SECRET, config=config) as server:
        srv = server.backend.server
        server.register_region(bytearray(64))

        def drops() -> int:
            return srv.stats.preauth_evicted + srv.stats.auth_failures + srv.stats.refused_busy

        with _attack(server.address, target=32):
            _poll(lambda: drops() >= floods and srv.stats.drop_logs_suppressed > 0, 30,
                  f"{floods} unauthenticated connections being dropped")
            # a summary line comes while the flood goes on, once a window ends
            _poll(lambda: any("unauthenticated connections dropped in the last" in r.getMessage()
                              for r in caplog.records), 10 * window_s + 5, "a summary line")
    elapsed_s = time.monotonic() - t0
    total = drops()  # the server is closed: its counters and its log are final
    lines = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG and r.levelno >= logging.WARNING]
    summaries = [m for m in lines if "unauthenticated connections dropped in the last" in m]
    single = [m for m in lines if m not in summaries]
    windows = elapsed_s / window_s + 1
    assert len(lines) <= (acceptor.DROP_LOG_BURST + 1) * windows, \
        f"{len(lines)} warning lines for {total} dropped connections in {elapsed_s:.1f} s"
    # every drop is logged one by one or counted in exactly one summary
    unlogged = sum(int(re.search(r"; (\d+) event\(s\) not logged one by one", m).group(1)) for m in summaries)
    assert unlogged == srv.stats.drop_logs_suppressed
    assert len(single) + unlogged == total, (len(single), unlogged, total)
    assert all(re.search(r"dropping unauthenticated|authentication failed|already serving", m) for m in single), single


def test_a_client_is_answered_busy_while_every_authenticated_slot_is_taken_and_served_once_one_frees():
    config = TcpConfig(max_server_connections=1)
    served = np.random.default_rng(5).integers(0, 256, REGION_BYTES, dtype=np.uint8)
    with TransferEngine("tcp", secret=SECRET, config=config) as server:
        srv = server.backend.server
        rdesc = server.register_region(served)
        holder = TransferEngine("tcp", secret=SECRET, serve=False, config=TcpConfig(connections_per_peer=1))
        try:
            holder.open_segment(server.address)  # keeps its connection, the only authenticated slot
            _poll(lambda: srv.stats.authenticated == 1, 5, "the holder authenticating")
            with TransferEngine("tcp", secret=SECRET, serve=False) as late:
                local = np.zeros(REGION_BYTES, dtype=np.uint8)
                ldesc = late.register_region(local)
                # the deadline passes while the slot stays taken: TIMEOUT naming the server's reason
                with pytest.raises(TransferError, match=r"busy: already serving 1 authenticated connections "
                                                    r"\(max_server_connections\)"):
                    late.open_segment(server.address, timeout_s=0.3)
                assert srv.stats.refused_busy >= 1 and late.backend.client.stats.busy_retries >= 1
                # then the holder goes: the late client, retrying meanwhile, is served
                done: list[object] = []

                def fetch() -> None:
                    try:
                        seg = late.open_segment(server.address, timeout_s=10)
                        late.read(ldesc, 0, seg, rdesc.region_id, 0, REGION_BYTES, timeout_s=10)
                        done.append(True)
                    except Exception as e:  # reported by the assertion below
                        done.append(e)

                t = threading.Thread(target=fetch)
                retries = late.backend.client.stats.busy_retries
                t.start()
                try:
                    _poll(lambda: late.backend.client.stats.busy_retries > retries, 5, "the late client retrying")
                    holder.close()
                finally:
                    t.join(15)
                assert done == [True], done
                assert local.tobytes() == served.tobytes()
        finally:
            holder.close()
        assert srv.stats.authenticated == 2, srv.stats


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "8"])
def test_config_rejects_a_bad_preauth_cap_naming_the_field(value):
    with pytest.raises(ValueError, match="max_preauth_connections"):
        TcpConfig(max_preauth_connections=value)


def test_retry_busy_names_the_busy_reason_when_the_deadline_cuts_a_later_try():
    """A try after a BUSY answer that the deadline cuts short (the server had no time to answer) still ends
    naming the server's reason; a timeout with no BUSY answer before it passes through as it is."""

    class Busy(Exception):
        pass

    def connect_busy_then_cut(answers: list[str]):
        def connect() -> None:
            if answers:
                raise Busy(answers.pop())
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise socket.timeout("deadline passed")
        return connect

    stats, logger = SimpleNamespace(busy_retries=0), logging.getLogger(SERVER_LOG)
    deadline = time.monotonic() + 1.0
    with pytest.raises(socket.timeout, match=r"^127.0.0.1:1 is busy: already serving 1 authenticated connections "
                                             r"\(tried again until the deadline\)$"):
        retry_busy(connect_busy_then_cut(["127.0.0.1:1 is busy: already serving 1 authenticated connections"]), Busy,
                   deadline, stats, logger)
    assert stats.busy_retries == 1
    deadline = time.monotonic() + 0.05
    with pytest.raises(socket.timeout, match=r"^deadline passed$"):
        retry_busy(connect_busy_then_cut([]), Busy, deadline, stats, logger)
    assert stats.busy_retries == 1
