"""The tcp backend under faults and hostile input: each of issue 13's item-6 cases is one test here.

What it shows:

- The serving process SIGKILLed mid-batch (at a point drawn from a seeded generator, by polling
  ``batch.statuses()``): every request ends FAILED or TIMEOUT with a reason, well within the batch's
  deadline; a COMPLETED READ holds exactly the peer's bytes, and no request still pending when the
  peer was reaped completes unless the peer sent its answer before dying (so a READ of it verifies).
- A peer restarted on the same port (``PeerProcess(port=old_port)``): the next transfer succeeds
  with no manual step, whether the client's stale pooled connections are caught by the idle probe or
  only when a request on them breaks (then it is retried on a fresh connection).
- A connection idle for 10 s: the next transfer succeeds, on a peer that keeps the connection (it is
  reused) and on one that dropped it meanwhile (the probe replaces it).
- Garbage, truncated, oversized, out-of-range and unknown-opcode frames from a hand-made socket that
  passed the real HMAC handshake: that connection is closed with a logged reason (and a status frame
  where the stream allows one), other peers keep being served, and no region stays in use.
- A request the peer refuses (its region went away) ends FAILED with the peer's reason, alone: the
  requests pipelined before and after it on the same connection complete (a 4 MiB WRITE included,
  whose unread payload must not turn the server's close into a reset that destroys their answers).
- A wrong secret is refused on either side (a client's open_segment raises, a transfer to a server
  whose secret changed ends FAILED, a server proving the wrong secret is refused by the client), and
  the server counts it in ``stats.auth_failures``.
- Peers that never complete the handshake (silent or trickling a byte at a time) are closed by
  ``auth_timeout_s`` while the server goes on serving others.
- A slow writer (a WRITE header and half its payload) or slow reader (a READ answer it stops reading)
  is timed out after ``progress_timeout_s`` and freed: the connection drops, the region's in-use count
  returns to 0, so ``unregister_region`` (which waited for it) returns.
- A server drops a connection idle past ``server_idle_timeout_s``.
- Client deadlines: requests to a stalled peer (SIGSTOP) end TIMEOUT within ``timeout_s`` plus slack,
  on a pooled connection and on a fresh one whose handshake never comes; the peer, resumed, is served
  again.

Waits are polls with deadlines (the 10-s idle test polls until 10 s have passed: the wait is the
point); random choices come from seeded generators named in assertion messages.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time

import crc32c
import numpy as np
import pytest

from polling import wait_stopped as _poll_stopped
from polling import wait_until

from quillcache.transfer import Op, Outcome, TcpConfig, TransferEngine, TransferError, TransferRequest
from quillcache.transfer import protocol as P
from quillcache.transfer.peer import PeerProcess, fill_pattern

SECRET = "quillcache-transfer-tests-secret-0123456789"
OTHER_SECRET = "a-different-cluster-secret-9876543210"
MiB = 1 << 20
SERVER_LOG = "quillcache.transfer.server"


def _poll(predicate, timeout_s: float, what: str, interval_s: float = 0.002) -> None:
    wait_until(predicate, timeout_s, what, poll_s=interval_s)


def _crc(view) -> int:
    return crc32c.crc32c(memoryview(view))


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _raw_session(address: str, secret: str = SECRET, rcvbuf: int | None = None) -> socket.socket:
    """A hand-made client socket that has passed the real HMAC handshake (``protocol`` helpers only)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: no autotuning
    sock.settimeout(10)
    sock.connect(_host_port(address))
    server_nonce = P.decode_hello(_recv_exact(sock, P.HELLO.size))
    client_nonce = P.new_nonce()
    sock.sendall(P.encode_proof(client_nonce, P.client_proof(secret.encode(), server_nonce, client_nonce)))
    P.decode_accept(_recv_exact(sock, P.ACCEPT.size), secret.encode(), server_nonce, client_nonce)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def _read_to_eof(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes; fails if it has not closed within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    out = bytearray()
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the server did not close the connection within {timeout_s} s (got {len(out)} bytes)"
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(out)
        except socket.timeout:
            continue
        if not chunk:
            return bytes(out)
        out += chunk


@contextlib.contextmanager
def _server(config: TcpConfig | None = None, secret: str = SECRET, port: int = 0):
    engine = TransferEngine("tcp", secret=secret, port=port, config=config or TcpConfig())
    try:
        yield engine
    finally:
        engine.close()


def _req(op, local, lo, seg, remote_region, ro, n) -> TransferRequest:
    return TransferRequest(op, local.region_id, lo, seg.segment_id, remote_region, ro, n)


# ---- the serving process dies mid-batch ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("seed", [101, 202, 303])
def test_peer_sigkilled_mid_batch_every_request_ends_and_completed_reads_verify(seed):
    rng = np.random.default_rng(seed)
    peer_bytes, local_bytes, n = 64 * MiB, 192 * MiB, 1200
    half = peer_bytes // 2  # READs read the lower half of the peer's region, WRITEs write the upper half
    sizes = [int(math.exp(rng.uniform(math.log(4096), math.log(512 * 1024)))) for _ in range(n)]
    ops = [Op.READ if rng.random() < 0.6 else Op.WRITE for _ in range(n)]
    local_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # disjoint local ranges
    assert local_offsets[-1] + sizes[-1] <= local_bytes
    local = np.zeros(local_bytes, dtype=np.uint8)
    local[::4096] = 0
    with PeerProcess(peer_bytes, secret=SECRET, seed=seed) as peer, \
            TransferEngine("tcp", secret=SECRET, serve=False) as engine:
        expected = fill_pattern(half, seed)
        desc = engine.register_region(local)
        seg = engine.open_segment(peer.address)
        reqs = [_req(op, desc, int(local_offsets[i]), seg, peer.region_id,
                     int(rng.integers(0, half - sizes[i] + 1)) + (0 if op is Op.READ else half), sizes[i])
                for i, op in enumerate(ops)]
        kill_after = int(rng.integers(1, n // 4))
        timeout_s = 20.0
        batch = engine.submit(reqs, timeout_s=timeout_s)
        _poll(lambda: sum(s.outcome is Outcome.COMPLETED for s in batch.statuses()) >= kill_after, 30,
              f"seed {seed}: {kill_after} requests completing", interval_s=0.0005)
        pending = sum(s.outcome is Outcome.PENDING for s in batch.statuses())
        peer.kill()  # SIGKILL, then reaped
        killed_at = time.monotonic()
        at_death = batch.statuses()
        assert pending, f"seed {seed}: the batch finished before the kill; make it larger"
        statuses = batch.wait(timeout_s + 10)
        waited_s = time.monotonic() - killed_at
    where = f"seed {seed}, killed after {kill_after} completions"
    assert waited_s < timeout_s + 5, f"{where}: requests took {waited_s:.1f} s to end after the kill"
    ended = [s.outcome for s in statuses]
    assert Outcome.PENDING not in ended
    assert sum(o is not Outcome.COMPLETED for o in ended) > 0, f"{where}: the kill affected no request"
    for i, (req, st, before) in enumerate(zip(reqs, statuses, at_death)):
        if st.outcome is Outcome.COMPLETED:
            assert st.transferred_bytes == req.length_bytes, f"{where}, request {i}: {st}"
            if req.op is Op.READ:
                a, b, k = req.local_offset_bytes, req.remote_offset_bytes, req.length_bytes
                assert _crc(local[a:a + k]) == _crc(expected[b:b + k]), \
                    f"{where}, request {i} (pending at death: {before.outcome is Outcome.PENDING}): " \
                    "COMPLETED but its bytes are not the peer's"
        else:
            assert st.outcome in (Outcome.FAILED, Outcome.TIMEOUT) and st.reason, f"{where}, request {i}: {st}"
            assert before.outcome is not Outcome.COMPLETED  # an outcome never changes once reported
    # Pending when the peer was reaped yet COMPLETED: only a request whose answer the peer had already sent
    # (it sits in our socket buffer) can be, so at most the requests in flight on the connections then.
    late = sum(b.outcome is Outcome.PENDING and s.outcome is Outcome.COMPLETED for b, s in zip(at_death, statuses))
    in_flight_max = TcpConfig().window * TcpConfig().connections_per_peer
    assert late <= in_flight_max, f"{where}: {late} requests not answered at the kill were reported COMPLETED"


# ---- a peer restarted on the same port ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("first", ["sync-read", "batch"])
@pytest.mark.parametrize("stop", ["kill", "close"])
@pytest.mark.parametrize("idle_check_s", [None, 3600.0], ids=["default-probe", "no-probe"])
def test_a_peer_restarted_on_the_same_port_is_reached_with_no_connection_step(idle_check_s, stop, first):
    lanes = dict(lane_min_bytes=8 * MiB)  # four lanes for the 4 x 8 MiB batch below
    config = TcpConfig(**lanes) if idle_check_s is None else TcpConfig(idle_check_s=idle_check_s, **lanes)
    local = np.zeros(32 * MiB, dtype=np.uint8)
    with TransferEngine("tcp", secret=SECRET, serve=False, config=config) as engine:
        desc = engine.register_region(local)
        with PeerProcess(32 * MiB, secret=SECRET, seed=1) as old:
            port = _host_port(old.address)[1]
            seg = engine.open_segment(old.address)
            # Four lanes, run while the peer is stopped so none can hand its connection to another: the
            # pool then holds four connections, all of which the restart makes stale.
            fds = len(os.listdir("/proc/self/fd"))
            os.kill(old.pid, signal.SIGSTOP)
            _poll_stopped(old.pid)
            try:
                batch = engine.submit([_req(Op.READ, desc, i * 8 * MiB, seg, old.region_id, i * 8 * MiB, 8 * MiB)
                                       for i in range(4)], timeout_s=30)
                _poll(lambda: len(os.listdir("/proc/self/fd")) >= fds + 3, 10, "three more connections opening")
            finally:
                os.kill(old.pid, signal.SIGCONT)
            statuses = batch.wait(30)
            assert all(s.outcome is Outcome.COMPLETED for s in statuses), statuses
            assert engine.backend.client.stats.connects == 4
            old.kill() if stop == "kill" else old.close()
        with PeerProcess(32 * MiB, secret=SECRET, seed=2, port=port) as new:
            assert new.address == old.address
            # the new process's regions are new ones (ids drawn at random per process, so the old handle names
            # none of them): the segment is opened again; the stale pooled connections need no step at all
            seg = engine.open_segment(new.address)
            if first == "sync-read":
                engine.read(desc, 0, seg, new.region_id, 100, 65536, timeout_s=10)
            else:
                statuses = engine.submit([_req(Op.READ, desc, i * 16384, seg, new.region_id, 100 + i * 16384, 16384)
                                          for i in range(4)], timeout_s=10).wait(20)
                assert all(s.outcome is Outcome.COMPLETED for s in statuses), statuses
            assert _crc(local[:65536]) == _crc(fill_pattern(32 * MiB, 2)[100:100 + 65536])
            local[:MiB] = 7
            statuses = engine.transfer_sync([_req(Op.WRITE, desc, 0, seg, new.region_id, 5 * MiB, MiB)]
                                            + [_req(Op.READ, desc, (1 + i) * MiB, seg, new.region_id, i * MiB, MiB)
                                               for i in range(4)], timeout_s=10)
            assert all(s.outcome is Outcome.COMPLETED for s in statuses), statuses
            assert new.ask(f"crc {5 * MiB} {MiB}")["crc"] == _crc(local[:MiB])
        stats = engine.backend.client.stats
        assert stats.stale_dropped + stats.retries >= 1, stats


# ---- a connection idle for 10 s -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_connection_idle_for_ten_seconds_serves_the_next_transfer():
    with PeerProcess(MiB, secret=SECRET, seed=5) as keeps, \
            PeerProcess(MiB, secret=SECRET, seed=6, extra_args=("--server-idle-timeout-s", "3",
                                                                "--progress-timeout-s", "1")) as drops, \
            TransferEngine("tcp", secret=SECRET, serve=False) as e_keeps, \
            TransferEngine("tcp", secret=SECRET, serve=False) as e_drops:
        buffers = {}
        for peer, engine, seed in ((keeps, e_keeps, 5), (drops, e_drops, 6)):
            local = np.zeros(MiB, dtype=np.uint8)
            desc = engine.register_region(local)
            seg = engine.open_segment(peer.address)
            engine.read(desc, 0, seg, peer.region_id, 0, 4096)
            buffers[seed] = (local, desc, seg)
        idle_from = time.monotonic()
        _poll(lambda: time.monotonic() - idle_from >= 10.0, 15, "ten idle seconds", interval_s=0.1)
        for peer, engine, seed in ((keeps, e_keeps, 5), (drops, e_drops, 6)):
            local, desc, seg = buffers[seed]
            engine.read(desc, 4096, seg, peer.region_id, 4096, 65536, timeout_s=10)
            assert _crc(local[4096:4096 + 65536]) == _crc(fill_pattern(MiB, seed)[4096:4096 + 65536])
            local[:4096] = seed
            engine.write(desc, 0, seg, peer.region_id, 0, 4096, timeout_s=10)
            assert peer.ask("crc 0 4096")["crc"] == _crc(local[:4096])
        keep_stats, drop_stats = e_keeps.backend.client.stats, e_drops.backend.client.stats
        assert (keep_stats.connects, keep_stats.stale_dropped, keep_stats.retries) == (1, 0, 0), keep_stats
        assert drop_stats.connects == 2 and drop_stats.stale_dropped + drop_stats.retries >= 1, drop_stats
        assert drops.ask("stats")["timeouts"] >= 1  # the peer did drop the idle connection


@pytest.mark.parametrize("served", [0, 1, 3], ids=["fresh", "after-one-request", "after-three-requests"])
def test_the_server_drops_a_connection_idle_past_its_idle_timeout(served):
    idle_s = 0.3
    config = TcpConfig(server_idle_timeout_s=idle_s)  # progress_timeout_s stays at its default, 10 s
    with _server(config) as server:
        server.register_region(bytearray(b"i" * 64))
        sock = _raw_session(server.address)
        try:
            for rid in range(served):
                sock.sendall(P.encode_request(P.Opcode.READ, rid, 1, 0, 64))
                assert _recv_exact(sock, P.RESPONSE.size + 64)[P.RESPONSE.size:] == b"i" * 64
            t0 = time.monotonic()
            assert _read_to_eof(sock, 15) == b""
            took = time.monotonic() - t0
            assert idle_s <= took + 0.05 and took < idle_s + 2, \
                f"the connection, idle, was dropped after {took:.2f} s (server_idle_timeout_s={idle_s})"
            _poll(lambda: server.backend.server.connections() == 0, 5, "the server forgetting the connection")
            assert server.backend.server.stats.timeouts == 1
        finally:
            sock.close()


# ---- hostile frames after a real handshake ------------------------------------------------------------------------

def _frame(case: str, rid: int) -> tuple[bytes, bool]:
    """The bytes a hostile client sends for ``case``, and whether it then half-closes (else it stalls)."""
    REGION, READONLY = 1, 2
    if case == "garbage":
        return np.random.default_rng(9).integers(0, 256, P.REQUEST.size, dtype=np.uint8).tobytes(), False
    if case == "garbage-short":
        return b"GET / HTTP/1.1\r\n\r\n", True
    if case == "truncated-header-eof":
        return P.encode_request(P.Opcode.READ, rid, REGION, 0, 64)[:20], True
    if case == "truncated-header-stall":
        return P.encode_request(P.Opcode.READ, rid, REGION, 0, 64)[:20], False
    if case == "oversized-length":
        return P.encode_request(P.Opcode.WRITE, rid, REGION, 0, 1 << 40), False
    if case == "zero-length":
        return P.encode_request(P.Opcode.READ, rid, REGION, 0, 0), False
    if case == "no-such-region":
        return P.encode_request(P.Opcode.READ, rid, 999, 0, 64), False
    if case == "offset-out-of-range":
        return P.encode_request(P.Opcode.READ, rid, REGION, 60_000, 10_000), False
    if case == "offset-overflow":
        return P.encode_request(P.Opcode.WRITE, rid, REGION, (1 << 64) - 1, 1), False
    if case == "write-read-only":
        return P.encode_request(P.Opcode.WRITE, rid, READONLY, 0, 16) + b"x" * 16, False
    if case == "unknown-opcode":
        f = list(P.REQUEST.unpack(P.encode_request(P.Opcode.READ, rid, REGION, 0, 64)))
        f[2] = 9
        return P.REQUEST.pack(*f), False
    if case == "reserved-bits":
        return P.encode_request(P.Opcode.READ, rid, REGION, 0, 64, flags=4), False
    if case == "bad-version":
        f = list(P.REQUEST.unpack(P.encode_request(P.Opcode.READ, rid, REGION, 0, 64)))
        f[1] = 7
        return P.REQUEST.pack(*f), False
    if case == "truncated-write-payload-eof":
        return P.encode_request(P.Opcode.WRITE, rid, REGION, 0, 1000) + b"y" * 500, True
    raise AssertionError(case)


# case → (status frame expected back or None, text the server logs)
_HOSTILE = {
    "garbage": (P.Status.BAD_FRAME, "bad request magic"),
    "garbage-short": (None, "ended: peer closed the connection"),
    "truncated-header-eof": (None, "ended: peer closed the connection"),
    "truncated-header-stall": (None, "timed out"),
    "oversized-length": (P.Status.BAD_FRAME, "exceeds the server's limit"),
    "zero-length": (P.Status.BAD_FRAME, "zero-length READ"),
    "no-such-region": (P.Status.NO_REGION, "no region 999 is registered"),
    "offset-out-of-range": (P.Status.OUT_OF_RANGE, "range [60000, 70000) lies outside region 1 of 65536 bytes"),
    "offset-overflow": (P.Status.OUT_OF_RANGE, "lies outside region 1"),
    "write-read-only": (P.Status.READ_ONLY, "region 2 is read-only"),
    "unknown-opcode": (P.Status.BAD_FRAME, "unknown opcode 9"),
    "reserved-bits": (P.Status.BAD_FRAME, "reserved bits"),
    "bad-version": (P.Status.BAD_FRAME, "unsupported request protocol version 7"),
    "truncated-write-payload-eof": (None, "ended: peer closed the connection after 500 of 1000 bytes"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_hostile_frame_closes_only_its_connection_with_a_logged_reason(case, caplog):
    caplog.set_level(logging.DEBUG, logger=SERVER_LOG)
    status, logged = _HOSTILE[case]
    config = TcpConfig(progress_timeout_s=0.5, max_request_bytes=MiB)
    region = np.arange(65536, dtype=np.uint8)
    with _server(config) as server, TransferEngine("tcp", secret=SECRET, serve=False) as good:
        srv = server.backend.server
        rdesc = server.register_region(region)
        server.register_region(bytes(64))  # region 2, read-only
        assert rdesc.region_id == 1
        local = bytearray(65536)
        ldesc = good.register_region(local)
        seg = good.open_segment(server.address)
        good.read(ldesc, 0, seg, 1, 0, 1024)  # a well-behaved peer, connected before and after
        sock = _raw_session(server.address)
        try:
            payload, half_close = _frame(case, rid=77)
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            answer = _read_to_eof(sock, 10)  # the server closes this connection
        finally:
            sock.close()
        if status is None:
            assert answer == b"", (case, answer)
        else:
            resp = P.decode_response(answer[:P.RESPONSE.size])
            reason = answer[P.RESPONSE.size:].decode()
            assert resp.status is status and resp.length == len(reason), (case, resp, reason)
            assert logged in reason, (case, reason)
        assert any(logged in r.getMessage() and r.name == SERVER_LOG for r in caplog.records), \
            (case, [r.getMessage() for r in caplog.records])
        _poll(lambda: srv.connections() == 1, 5, f"{case}: the hostile connection going")
        # the good peer, on its same connection, is still served; then nothing holds the region
        good.read(ldesc, 0, seg, 1, 1000, 2000, timeout_s=5)
        assert bytes(local[:2000]) == region[1000:3000].tobytes()
        assert good.backend.client.stats.connects == 1
        server.unregister_region(rdesc, timeout_s=1)
        assert srv.stats.authenticated == 2


# ---- a request the peer refuses ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op, n", [(Op.READ, 4096), (Op.WRITE, 4096), (Op.WRITE, 4 * MiB)],
                         ids=["READ-4KiB", "WRITE-4KiB", "WRITE-4MiB"])
def test_a_request_the_peer_refuses_fails_alone_with_the_peers_reason(op, n):
    served = np.random.default_rng(12).integers(0, 256, MiB, dtype=np.uint8)
    with _server() as server, TransferEngine("tcp", secret=SECRET, serve=False) as client:
        r1 = server.register_region(served)
        r2 = server.register_region(np.zeros(4 * MiB, dtype=np.uint8))
        local = np.full(8 * MiB, 9, dtype=np.uint8)
        ldesc = client.register_region(local)
        seg = client.open_segment(server.address)  # lists region 2 ...
        server.unregister_region(r2)               # ... which the server then stops serving
        for attempt in range(3):
            # pipelined on one connection: the refused request between two good ones
            statuses = client.transfer_sync([_req(Op.READ, ldesc, 0, seg, r1.region_id, 10, 1000),
                                             _req(op, ldesc, 4 * MiB, seg, r2.region_id, 0, n),
                                             _req(Op.READ, ldesc, 2 * MiB, seg, r1.region_id, 20, 1000)],
                                            timeout_s=10)
            where = f"{op.name} of {n} bytes, attempt {attempt}"
            assert [s.outcome for s in statuses] == [Outcome.COMPLETED, Outcome.FAILED, Outcome.COMPLETED], \
                (where, statuses)
            assert "peer refused (NO_REGION)" in statuses[1].reason and "no region 2" in statuses[1].reason, \
                (where, statuses[1])
            assert local[:1000].tobytes() == served[10:1010].tobytes(), where
            assert local[2 * MiB:2 * MiB + 1000].tobytes() == served[20:1020].tobytes(), where
            with pytest.raises(TransferError, match="no region 2"):
                (client.read if op is Op.READ else client.write)(ldesc, 4 * MiB, seg, r2.region_id, 0, n,
                                                                 timeout_s=10)
        client.read(ldesc, 0, seg, r1.region_id, 0, MiB, timeout_s=10)  # and the peer serves on
        assert local[:MiB].tobytes() == served.tobytes()


# ---- authentication -----------------------------------------------------------------------------------------------

def test_a_wrong_secret_is_refused_and_counted(caplog):
    caplog.set_level(logging.WARNING, logger=SERVER_LOG)
    with _server() as server, TransferEngine("tcp", secret=OTHER_SECRET, serve=False) as intruder:
        server.register_region(bytearray(64))
        with pytest.raises(TransferError, match="wrong shared secret"):
            intruder.open_segment(server.address)
        srv = server.backend.server
        _poll(lambda: srv.stats.auth_failures == 1, 5, "the server counting the failed handshake")
        assert srv.stats.authenticated == 0 and srv.stats.requests == 0
        assert any("authentication failed" in r.getMessage() for r in caplog.records)
        _poll(lambda: srv.connections() == 0, 5, "the refused connection going")


def test_a_transfer_to_a_server_whose_secret_changed_ends_failed():
    region = bytearray(b"z" * 4096)
    with TransferEngine("tcp", secret=SECRET, serve=False) as client:
        local = bytearray(4096)
        ldesc = client.register_region(local)
        with _server() as first:
            first.register_region(region)
            port = _host_port(first.address)[1]
            seg = client.open_segment(first.address)
            client.read(ldesc, 0, seg, 1, 0, 16)
        with _server(secret=OTHER_SECRET, port=port) as second:
            second.register_region(region)
            (st,) = client.transfer_sync([_req(Op.READ, ldesc, 0, seg, 1, 0, 64)], timeout_s=5)
            assert st.outcome is Outcome.FAILED and "wrong shared secret" in st.reason, st
            _poll(lambda: second.backend.server.stats.auth_failures >= 1, 5, "the server counting it")
            assert second.backend.server.stats.requests == 0


def test_a_server_that_cannot_prove_the_secret_is_refused_by_the_client():
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(10)

    def impostor() -> None:  # passes HELLO, reads the proof, answers with an ACCEPT it cannot have computed
        with contextlib.suppress(OSError):
            conn, _ = lsock.accept()
            with conn:
                nonce = P.new_nonce()
                conn.sendall(P.encode_hello(nonce))
                proof = _recv_exact(conn, P.PROOF.size)
                client_nonce = P.PROOF.unpack(proof)[2]
                conn.sendall(P.encode_accept(P.server_proof(OTHER_SECRET.encode(), nonce, client_nonce)))
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(1)

    t = threading.Thread(target=impostor)
    t.start()
    try:
        with TransferEngine("tcp", secret=SECRET, serve=False) as client:
            with pytest.raises(TransferError, match="server's proof does not match"):
                client.open_segment(f"127.0.0.1:{lsock.getsockname()[1]}")
    finally:
        t.join(10)
        lsock.close()


def test_peers_that_never_finish_the_handshake_cost_nothing_past_auth_timeout(caplog):
    caplog.set_level(logging.WARNING, logger=SERVER_LOG)
    auth_s = 0.5
    with _server(TcpConfig(auth_timeout_s=auth_s)) as server:
        srv = server.backend.server
        server.register_region(bytearray(b"q" * 256))
        host, port = _host_port(server.address)
        silent = [socket.create_connection((host, port), timeout=5) for _ in range(8)]
        tricklers = [socket.create_connection((host, port), timeout=5) for _ in range(8)]
        t0 = time.monotonic()
        try:
            with TransferEngine("tcp", secret=SECRET, serve=False) as good:  # served meanwhile
                local = bytearray(256)
                desc = good.register_region(local)
                seg = good.open_segment(server.address)
                good.read(desc, 0, seg, 1, 0, 256)
                assert local == b"q" * 256
            for s in tricklers:
                assert _recv_exact(s, P.HELLO.size)[:4] == b"QCTH"
                s.setblocking(False)
            open_ = list(tricklers)
            while open_:  # one byte of a would-be proof every 50 ms: never done within auth_timeout_s
                assert time.monotonic() - t0 < auth_s + 3, f"{len(open_)} trickling peers still held"
                for s in list(open_):
                    try:
                        s.send(b"Q")
                        if s.recv(1) == b"":
                            open_.remove(s)
                    except BlockingIOError:
                        pass
                    except OSError:  # reset: the server closed it
                        open_.remove(s)
                time.sleep(0.05)  # the trickle's pace, inside the deadline-bounded poll
            for s in silent:
                assert _read_to_eof(s, auth_s + 3)[:4] == b"QCTH"
            _poll(lambda: srv.connections() == 0, 5, "the unauthenticated connections going")
            assert time.monotonic() - t0 < auth_s + 3
            assert srv.stats.auth_failures == 16 and srv.stats.authenticated == 1, srv.stats
        finally:
            for s in silent + tricklers:
                s.close()


# ---- slow readers and writers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("who", ["writer", "reader"])
def test_a_slow_peer_is_timed_out_and_its_region_freed(who, caplog):
    caplog.set_level(logging.WARNING, logger=SERVER_LOG)
    progress_s = 0.5
    size = 16 * MiB
    region = np.zeros(size, dtype=np.uint8)
    with _server(TcpConfig(progress_timeout_s=progress_s)) as server:
        srv = server.backend.server
        desc = server.register_region(region)
        sock = _raw_session(server.address, rcvbuf=64 * 1024)
        try:
            if who == "writer":
                half = np.full(size // 2, 0x6B, dtype=np.uint8)
                sock.sendall(P.encode_request(P.Opcode.WRITE, 5, desc.region_id, 0, size) + half.tobytes())
                # the server is receiving straight into the region: it holds it until the payload ends
                _poll(lambda: region[size // 2 - 1] == 0x6B, 10, "half the payload landing in the region")
            else:
                sock.sendall(P.encode_request(P.Opcode.READ, 5, desc.region_id, 0, size))
                resp = P.decode_response(_recv_exact(sock, P.RESPONSE.size))
                assert (resp.status, resp.length) == (P.Status.OK, size)
                _recv_exact(sock, 4096)  # then stop reading: the server's send stalls on a full window
            stalled_at = time.monotonic()
            server.unregister_region(desc, timeout_s=10)  # waits for the server to give the region up
            freed_s = time.monotonic() - stalled_at
            assert srv.stats.timeouts == 1, srv.stats
            assert freed_s < progress_s + 5, f"the slow {who} held the region for {freed_s:.1f} s"
            _poll(lambda: srv.connections() == 0, 5, f"the slow {who}'s connection going")
            assert any("timed out" in r.getMessage() for r in caplog.records)
            if who == "writer":  # the server closed: the socket reports EOF or a reset
                assert _read_to_eof(sock, 5) == b""
        finally:
            sock.close()


# ---- client-side deadlines ----------------------------------------------------------------------------------------

def test_requests_to_a_stalled_peer_end_timeout_within_their_deadline():
    with PeerProcess(32 * MiB, secret=SECRET, seed=8) as peer:
        stopped = False
        try:
            with TransferEngine("tcp", secret=SECRET, serve=False) as engine:
                local = np.ones(32 * MiB, dtype=np.uint8)
                desc = engine.register_region(local)
                seg = engine.open_segment(peer.address)
                engine.read(desc, 0, seg, peer.region_id, 0, 4096)
                os.kill(peer.pid, signal.SIGSTOP)
                stopped = True
                _poll_stopped(peer.pid)
                deadline_s, slack_s = 0.5, 2.0
                # on the pooled connection: a READ nobody answers and a WRITE too large for the socket buffers
                t0 = time.monotonic()
                statuses = engine.submit([_req(Op.READ, desc, 0, seg, peer.region_id, 0, MiB),
                                          _req(Op.WRITE, desc, MiB, seg, peer.region_id, MiB, 24 * MiB)],
                                         timeout_s=deadline_s).wait(deadline_s + 10)
                took = time.monotonic() - t0
                assert [s.outcome for s in statuses] == [Outcome.TIMEOUT] * 2, statuses
                assert all("deadline passed" in s.reason for s in statuses), statuses
                assert deadline_s <= took < deadline_s + slack_s, took
                # on a fresh connection: the kernel accepts it, the stopped peer never sends HELLO
                t0 = time.monotonic()
                (st,) = engine.transfer_sync([_req(Op.READ, desc, 0, seg, peer.region_id, 0, 4096)],
                                             timeout_s=deadline_s)
                took = time.monotonic() - t0
                assert st.outcome is Outcome.TIMEOUT and "deadline" in st.reason, st
                assert took < deadline_s + slack_s, took
                os.kill(peer.pid, signal.SIGCONT)
                stopped = False
                engine.read(desc, 0, seg, peer.region_id, 0, MiB, timeout_s=10)  # resumed: served again
                assert _crc(local[:MiB]) == _crc(fill_pattern(32 * MiB, 8)[:MiB])
        finally:
            if stopped:
                os.kill(peer.pid, signal.SIGCONT)
