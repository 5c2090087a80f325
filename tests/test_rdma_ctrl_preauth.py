"""The rdma backend's control listener against peers that do not know the secret (the TCP server's rules).

What it shows, with the fake verbs layer of ``test_transfer_rdma`` (no RDMA device) and real sockets on
127.0.0.1:

- A flood of silent control connections (an attacker without the secret keeping many more than
  ``max_preauth_connections`` open, re-opening each one the server drops) does not stop peers with the
  secret: fresh engines open the segment and READ and WRITE exact bytes through the backend while the
  flood goes on, even with ``max_server_connections`` far below the flood's size.
- During the flood the server holds at most ``max_preauth_connections`` authenticating connections and
  spends no thread on any of them (only authenticated ones get a ``qc-rdma-ctrl-conn`` thread).
- The dropped connections leave a rate-limited log: far fewer warning lines than drops, a summary line
  per window, and every drop either logged or counted in a summary.
- Authenticated control connections still obey ``max_server_connections``: one more is answered BUSY
  with the server's reason, and gets in once a slot frees.
- ``close`` with authenticating connections pending returns promptly, closes them, and leaves no
  ``qc-rdma-ctrl`` thread behind.

Waits are polls with deadlines; engines are closed by the ``fake`` fixture (and sockets in ``finally``).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import numpy as np
import pytest
from polling import wait_until
from test_transfer_preauth import REGION_BYTES, _attack, _read_then_write
from test_transfer_rdma import SECRET, fake  # noqa: F401  (``fake``: the fixture, used by name)

from quillcache.transfer import TcpConfig, TransferError
from quillcache.transfer import protocol as P
from quillcache.transfer import rdma_control as C
from quillcache.transfer.backends import acceptor
from quillcache.transfer.rdma_verbs import parse_rdma_address

_SECRET = SECRET.encode()


def _ctrl(address: str) -> tuple[str, int]:
    host, _, ctrl = parse_rdma_address(address)
    return host, ctrl


def _conn_threads() -> int:
    return sum(t.name.startswith("qc-rdma-ctrl-conn") for t in threading.enumerate())


def _ctrl_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("qc-rdma-ctrl")]


def _authenticated(address: str) -> socket.socket:
    """A control connection that passed the handshake (and then sends nothing)."""
    host, port = _ctrl(address)
    return C.connect_peer(host, port, _SECRET, connect_timeout_s=2, auth_timeout_s=2, progress_s=2,
                          deadline=time.monotonic() + 5)


def test_a_flood_of_silent_control_connections_does_not_lock_out_peers_with_the_secret(fake):  # noqa: F811
    preauth, rounds, round_deadline_s = 4, 4, 5.0
    # auth_timeout_s far longer than the test: a silent connection is never let go for want of a proof
    config = TcpConfig(max_preauth_connections=preauth, max_server_connections=2, auth_timeout_s=60.0)
    rng = np.random.default_rng(2027)
    served = rng.integers(0, 256, REGION_BYTES, dtype=np.uint8)
    server = fake.make(config=config)
    backend = server.backend
    rdesc = server.register_region(served)
    host, port = _ctrl(server.address)
    with _attack(f"{host}:{port}", target=8 * preauth) as attacker:
        wait_until(lambda: attacker.opened >= 16 * preauth, 10, "the attacker flooding the control port", 0.002)
        for r in range(rounds):
            opened_before = attacker.opened
            t0 = time.monotonic()
            client = fake.make()  # a fresh peer: fresh control connection
            _read_then_write(client, server.address, rdesc, served, rng, round_deadline_s, r)
            # while served: no unauthenticated connection holds a thread or a slot past the cap
            assert backend.preauth_connections() <= preauth
            assert _conn_threads() <= backend.ctrl_connections() <= config.max_server_connections
            retries = client.backend.ctrl_stats.busy_retries
            client.close()  # its control connection goes: the server's slot frees
            took = time.monotonic() - t0
            assert took < round_deadline_s, f"round {r} took {took:.2f} s ({retries} BUSY retries)"
            # the flood goes on (the server never stops accepting it); on a loaded 2-core machine a quick round
            # can pass before the attacker's thread is scheduled again, so it gets a bounded wait, not zero
            wait_until(lambda: attacker.opened > opened_before, 5, f"round {r}: the attack going on", 0.002)
        assert backend.ctrl_stats.authenticated >= rounds
        assert backend.ctrl_stats.preauth_evicted > 4 * preauth and backend.ctrl_stats.refused_busy == 0, \
            backend.ctrl_stats


def test_control_threads_and_connections_stay_bounded_during_a_flood(fake):  # noqa: F811
    preauth, floods = 4, 600
    config = TcpConfig(max_preauth_connections=preauth, max_server_connections=8, auth_timeout_s=60.0)
    server = fake.make(config=config)
    backend = server.backend
    host, port = _ctrl(server.address)
    most_preauth = 0

    def no_threads() -> None:  # nobody authenticated: no connection thread at all
        threads = _conn_threads()
        assert threads == 0, f"{threads} control threads for unauthenticated connections"

    def flooding(attacker, n: int, sample: bool) -> bool:
        nonlocal most_preauth
        no_threads()
        if sample:  # and never more than the pre-auth cap held
            most_preauth = max(most_preauth, backend.preauth_connections())
        return attacker.opened >= n

    with _attack(f"{host}:{port}", target=16 * preauth) as attacker:
        wait_until(lambda: flooding(attacker, 32 * preauth, False), 30, "the attacker flooding the control port", 0.001)
        wait_until(lambda: flooding(attacker, floods, True), 30, f"{floods} silent control connections opened", 0.001)
    assert 0 < most_preauth <= preauth, most_preauth
    assert backend.ctrl_connections() == 0
    assert backend.ctrl_stats.preauth_evicted >= floods - 16 * preauth - preauth, backend.ctrl_stats


def test_dropped_control_connections_leave_a_rate_limited_log(fake, caplog, monkeypatch):  # noqa: F811
    window_s, floods, target = 0.3, 1500, 32
    monkeypatch.setattr(acceptor, "DROP_LOG_WINDOW_S", window_s)  # read when the backend is built
    caplog.set_level(logging.WARNING)
    config = TcpConfig(max_preauth_connections=4, max_server_connections=8, auth_timeout_s=0.2)
    t0 = time.monotonic()
    server = fake.make(config=config)
    backend = server.backend
    host, port = _ctrl(server.address)
    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name.startswith("quillcache.transfer") and r.levelno >= logging.WARNING]

    def bound(elapsed_s: float) -> float:
        return (acceptor.DROP_LOG_BURST + 1) * (elapsed_s / window_s + 1)

    with _attack(f"{host}:{port}", target=target) as attacker:
        wait_until(lambda: attacker.opened >= floods + target, 60, f"{floods} control connections dropped", 0.002)
        n = len(warnings())
        assert n <= bound(time.monotonic() - t0), f"{n} warning lines for {attacker.opened - target} drops"
        wait_until(lambda: any("unauthenticated connections dropped in the last" in r.getMessage()
                               for r in caplog.records), 10 * window_s + 5, "a summary line during the flood")
    server.close()  # the log and the counters are final
    elapsed_s = time.monotonic() - t0
    dropped = attacker.opened - target  # each re-opened connection replaced one the server dropped
    lines = warnings()
    assert len(lines) <= bound(elapsed_s), \
        f"{len(lines)} warning lines for {dropped} dropped control connections in {elapsed_s:.1f} s"
    assert len(lines) * 10 < dropped, (len(lines), dropped)
    # every drop is logged one by one or counted in exactly one summary
    summaries = [m for m in lines if "unauthenticated connections dropped in the last" in m]
    single = [m for m in lines if m not in summaries]
    assert all("RDMA control" in m for m in lines), lines
    unlogged = sum(int(re.search(r"; (\d+) event\(s\) not logged one by one", m).group(1)) for m in summaries)
    stats = backend.ctrl_stats
    assert unlogged == stats.drop_logs_suppressed > 0
    assert len(single) + unlogged == stats.preauth_evicted + stats.auth_failures + stats.refused_busy, stats


def test_authenticated_control_connections_still_obey_max_server_connections(fake):  # noqa: F811
    config = TcpConfig(max_server_connections=2)
    served = bytearray(b"S" * 4096)
    server = fake.make(config=config)
    backend = server.backend
    rdesc = server.register_region(served)
    held = [_authenticated(server.address), _authenticated(server.address)]
    try:
        wait_until(lambda: _conn_threads() == 2, 5, "two authenticated control connections")
        with pytest.raises(C.Busy, match=r"busy: already serving 2 authenticated RDMA control connections "
                                         r"\(max_server_connections\)"):
            _authenticated(server.address)
        assert _conn_threads() == 2 and backend.ctrl_stats.refused_busy >= 1
        late = fake.make()
        local = bytearray(4096)
        ldesc = late.register_region(local)
        with pytest.raises(TransferError, match=r"busy: already serving 2 authenticated RDMA control connections"):
            late.open_segment(server.address, timeout_s=0.5)  # BUSY, tried again, until the deadline
        assert late.backend.ctrl_stats.busy_retries >= 1
        held.pop().close()  # a slot frees: the late peer gets in
        wait_until(lambda: backend.ctrl_connections() == 1, 5, "the server letting the closed connection go")
        seg = late.open_segment(server.address, timeout_s=5)
        late.read(ldesc, 0, seg, rdesc.region_id, 0, 4096, timeout_s=5)
        assert bytes(local) == bytes(served)
        assert backend.ctrl_connections() == 2 and _conn_threads() == 2
    finally:
        for s in held:
            s.close()


def test_close_with_pending_silent_connections_is_prompt_and_leaves_no_ctrl_thread(fake):  # noqa: F811
    preauth, silent = 4, 12
    config = TcpConfig(max_preauth_connections=preauth, max_server_connections=8, auth_timeout_s=60.0)
    server = fake.make(config=config)
    host, port = _ctrl(server.address)
    socks: list[socket.socket] = []
    try:
        authed = _authenticated(server.address)  # one authenticated too (its thread waits for a QP record)
        socks.append(authed)
        for _ in range(silent):
            socks.append(socket.create_connection((host, port), timeout=2))
        newest = socks[-preauth:]
        hellos = {s: b"" for s in newest}

        def challenged() -> bool:  # the newest ones are authenticating: each got its HELLO
            for s in newest:
                s.settimeout(0.001)
                try:
                    hellos[s] += s.recv(P.HELLO.size - len(hellos[s])) if len(hellos[s]) < P.HELLO.size else b""
                except (TimeoutError, BlockingIOError):
                    pass
            return all(len(h) == P.HELLO.size for h in hellos.values())

        wait_until(challenged, 5, f"the newest {preauth} silent connections being challenged")
        assert _ctrl_threads()
        t0 = time.monotonic()
        server.close()
        took = time.monotonic() - t0
        assert took < 1.0, f"close took {took:.2f} s"
        assert _ctrl_threads() == [], _ctrl_threads()
        # every connection, authenticating or not, was closed by the server: each reads EOF (or a reset)
        deadline = time.monotonic() + 5
        for s in socks:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                while s.recv(4096):
                    pass
            except (TimeoutError, socket.timeout):
                pytest.fail("a control connection was left open after close()")
            except OSError:
                pass  # reset: closed too
    finally:
        for s in socks:
            s.close()
