"""Regression tests for the transfer engine's review findings (each fails without its fix).

1. A READ followed by a WRITE on ONE connection, each far larger than the socket buffers, completes
   (both the compiled ``FastChannel`` and the plain ``Channel``): the client receives the answers it is
   owed before it sends a WRITE's payload, so client and server are never both blocked sending. A
   seeded random mix of READs and WRITEs on one connection moves the exact bytes.
2. RDMA (the suite's ``FakeVerbs``): while ``unregister_region`` waits for an in-flight user, a peer's key
   refresh does not register the region's MR again; once it returns no MR covers the buffer and a
   peer's WRITE into it fails. A failed wait leaves the region registered and served again.
3. A listener that answers the handshake with an OK response frame of any length gets
   ``ProtocolError`` at once, nothing allocated for that length.
4. A connection thread that cannot start costs that connection a BUSY answer (the client tries again
   and is served); a selector that refuses one connection costs only that one; the accepting thread
   keeps accepting, and ``close`` never joins a thread that did not start.
5. ``close`` racing ``submit``: the lanes not yet started end FAILED; nothing stays pending or counted.
6. ``TcpConfig`` refuses infinite, NaN and overlong timeouts naming the field; ``MAX_TIMEOUT_S`` works.
7. The peer helper answers a malformed or out-of-range ``crc`` command with an error and keeps serving;
   a peer that exited is reported as exited.

Servers and engines are closed in ``finally`` (context managers, fixtures); waits are polls with
deadlines; races are forced with hooks, not sleeps.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
import tracemalloc
from types import SimpleNamespace

import crc32c
import numpy as np
import pytest
from polling import wait_until
from test_transfer_rdma import fake  # noqa: F401  (the FakeVerbs fixture, used by name)

from quillcache.transfer import (Op, Outcome, ProtocolError, RegionError, TcpConfig, TransferEngine, TransferError,
                                 TransferRequest)
from quillcache.transfer import protocol as P
from quillcache.transfer import rdma_verbs as V
from quillcache.transfer.backends import acceptor
from quillcache.transfer.backends.sockets import MAX_TIMEOUT_S
from quillcache.transfer.peer import PeerProcess, fill_pattern

SECRET = "quillcache-transfer-tests-secret-0123456789"
MiB = 1 << 20
TIMEOUTS = ("connect_timeout_s", "progress_timeout_s", "idle_check_s", "auth_timeout_s", "server_idle_timeout_s")


def _pair(cfg: TcpConfig):
    return (TransferEngine("tcp", secret=SECRET, config=cfg),
            TransferEngine("tcp", secret=SECRET, config=cfg, serve=False))


# ---- 1: READ then WRITE on one connection ---------------------------------------------------------------------

@pytest.mark.parametrize("fast_path", [True, False])
def test_read_then_write_larger_than_the_socket_buffers_completes_on_one_connection(fast_path):
    size = 16 * MiB  # the buffers are 256 KiB asked (the kernel doubles that): far more is owed than fits
    cfg = TcpConfig(connections_per_peer=1, progress_timeout_s=2.0, socket_buffer_bytes=256 << 10,
                    fast_path=fast_path)
    server, client = _pair(cfg)
    with server, client:
        remote_buf = fill_pattern(2 * size, 3)
        local_buf = fill_pattern(2 * size, 4)
        remote = server.register_region(remote_buf)
        local = client.register_region(local_buf)
        seg = client.open_segment(server.address)
        want_read, want_written = remote_buf[:size].copy(), local_buf[size:].copy()
        st = client.transfer_sync([
            TransferRequest(Op.READ, local.region_id, 0, seg.segment_id, remote.region_id, 0, size),
            TransferRequest(Op.WRITE, local.region_id, size, seg.segment_id, remote.region_id, size, size)],
            timeout_s=30)
        assert [(s.outcome, s.reason) for s in st] == [(Outcome.COMPLETED, "")] * 2
        assert np.array_equal(local_buf[:size], want_read) and np.array_equal(remote_buf[size:], want_written)
        assert server.backend.server.stats.timeouts == 0


def test_random_read_write_mix_on_one_connection_moves_the_exact_bytes():
    seed = 20240611
    rng = np.random.default_rng(seed)
    n, slot = 40, 2 * MiB
    cfg = TcpConfig(connections_per_peer=1, progress_timeout_s=2.0, socket_buffer_bytes=64 << 10, window=8)
    server, client = _pair(cfg)
    with server, client:
        remote_buf, local_buf = fill_pattern(n * slot, 5), fill_pattern(n * slot, 6)
        remote_want, local_want = remote_buf.copy(), local_buf.copy()
        remote = server.register_region(remote_buf)
        local = client.register_region(local_buf)
        seg = client.open_segment(server.address)
        reqs = []
        for i in range(n):  # disjoint slots: the outcome does not depend on the order the server applies them
            op = Op.READ if rng.random() < 0.5 else Op.WRITE
            length = int(rng.integers(1, slot + 1))
            reqs.append(TransferRequest(op, local.region_id, i * slot, seg.segment_id, remote.region_id, i * slot,
                                        length))
            src, dst = (remote_want, local_want) if op is Op.READ else (local_want, remote_want)
            dst[i * slot:i * slot + length] = src[i * slot:i * slot + length]
        st = client.transfer_sync(reqs, timeout_s=60)
        assert [s.outcome for s in st] == [Outcome.COMPLETED] * n, (seed, [s.reason for s in st if s.reason][:1])
        assert np.array_equal(local_buf, local_want), seed
        assert np.array_equal(remote_buf, remote_want), seed


# ---- 2: RDMA unregister while a user is in flight --------------------------------------------------------------

def _mrs_at(fv, addr: int) -> list[int]:
    return [k for k, (a, _, _) in fv.mrs.items() if a == addr]


def test_rdma_region_being_unregistered_is_not_registered_again_by_a_peer_refresh(fake):  # noqa: F811
    a, b = fake.make(), fake.make()
    buf = bytearray(b"A" * 4096)
    rb = b.register_region(buf, name="victim")
    la = a.register_region(bytearray(b"X" * 4096))
    addr = V.buffer_address(memoryview(buf))
    seg = a.open_segment(b.address)
    assert len(_mrs_at(fake, addr)) == 1
    b.regions.checkout(rb.region_id, 0, 16, write=False)  # a local user of b's region, still in flight
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.unregister_region(rb, timeout_s=30), done.set()), daemon=True)
    t.start()
    try:
        wait_until(lambda: not _mrs_at(fake, addr), 10, "the victim's MR deregistered")
        assert not done.is_set()  # unregister now waits for the user
        seg = a.open_segment(b.address)  # a's refresh: b's control thread syncs its MR table and sends keys
        assert _mrs_at(fake, addr) == [], "a retiring region was registered again (its new rkey sent to a peer)"
    finally:
        b.regions.release(rb.region_id)
        t.join(10)
    assert done.is_set() and len(b.regions) == 0
    (st,) = a.transfer_sync([TransferRequest(Op.WRITE, la.region_id, 0, seg.segment_id, rb.region_id, 0, 4096)])
    assert st.outcome is Outcome.FAILED
    assert bytes(buf) == b"A" * 4096  # nothing written into the buffer its owner now believes free


def test_rdma_region_whose_unregister_timed_out_is_served_again(fake):  # noqa: F811
    a, b = fake.make(), fake.make()
    buf = bytearray(b"B" * 4096)
    rb = b.register_region(buf)
    out = bytearray(4096)
    la = a.register_region(out)
    b.regions.checkout(rb.region_id, 0, 16, write=False)
    try:
        with pytest.raises(RegionError, match="in flight"):
            b.unregister_region(rb, timeout_s=0.01)
    finally:
        b.regions.release(rb.region_id)
    seg = a.open_segment(b.address)  # the refresh registers it again: it is still b's region
    a.read(la, 0, seg, rb.region_id, 0, 4096)
    assert bytes(out) == bytes(buf)


# ---- 3: an OK response frame in place of the handshake -----------------------------------------------------------

@pytest.fixture
def ok_frame_listener():
    """A listener that answers every connection with one OK response frame of ``length`` bytes, then nothing."""
    ls = socket.create_server(("127.0.0.1", 0))
    ls.settimeout(0.05)
    state = SimpleNamespace(length=0, stop=threading.Event(), conns=[],
                            address=f"127.0.0.1:{ls.getsockname()[1]}")

    def run():
        while not state.stop.is_set():
            try:
                c, _ = ls.accept()
            except socket.timeout:
                continue
            state.conns.append(c)
            c.sendall(P.encode_response(P.Status.OK, 0, state.length))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield state
    finally:
        state.stop.set()
        t.join(5)
        ls.close()
        for c in state.conns:
            c.close()


@pytest.mark.parametrize("length", [1 << 62, 256 * MiB])
def test_ok_response_in_place_of_hello_is_a_protocol_error_and_allocates_nothing(ok_frame_listener, length):
    ok_frame_listener.length = length
    with TransferEngine("tcp", secret=SECRET, serve=False) as eng:
        tracemalloc.start()
        try:
            t0 = time.monotonic()
            with pytest.raises(ProtocolError, match="answered OK in place of a handshake frame"):
                eng.open_segment(ok_frame_listener.address, timeout_s=5.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert time.monotonic() - t0 < 2.0  # refused at once, not after waiting for the promised bytes
        assert peak < 4 * MiB


# ---- 4: the listener survives resource failures ----------------------------------------------------------------

def test_a_connection_thread_that_cannot_start_is_answered_busy_and_accepting_goes_on(monkeypatch):
    failures = {"left": 1}

    class FlakyThread(threading.Thread):
        def start(self):
            if self.name.startswith("qc-transfer-conn") and failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(acceptor, "threading", SimpleNamespace(Thread=FlakyThread, Lock=threading.Lock))
    server = TransferEngine("tcp", secret=SECRET)
    try:
        server.register_region(np.ones(4096, np.uint8))
        srv = server.backend.server
        for _ in range(2):
            with TransferEngine("tcp", secret=SECRET, serve=False) as c:
                assert len(c.open_segment(server.address, timeout_s=5).regions) == 1
        assert failures["left"] == 0 and srv.stats.refused_busy == 1  # the failed one was answered BUSY
        assert srv._acceptor._thread.is_alive()
        wait_until(lambda: not srv._conns, 10, "the served connections ended")  # no slot kept by the failed one
    finally:
        server.close()  # raises RuntimeError joining a never-started thread without the fix


def test_close_never_joins_a_connection_thread_that_did_not_start():
    server = TransferEngine("tcp", secret=SECRET)
    a, b = socket.socketpair()
    try:
        srv = server.backend.server
        with srv._lock:  # what an acceptor that failed between recording and starting a thread leaves
            srv._conns[a] = threading.Thread(target=lambda: None)
    finally:
        server.close()
        a.close()
        b.close()


def test_a_connection_the_selector_refuses_fails_alone(monkeypatch):
    server = TransferEngine("tcp", secret=SECRET)
    try:
        server.register_region(np.ones(4096, np.uint8))
        acc = server.backend.server._acceptor
        sel = acc._sel
        real_register, refused = sel.register, []

        def register(fileobj, events, data=None):
            if data.__class__.__name__ == "_Pending" and not refused:
                refused.append(fileobj)
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return real_register(fileobj, events, data)

        monkeypatch.setattr(sel, "register", register)
        with TransferEngine("tcp", secret=SECRET, serve=False) as c:
            with pytest.raises(TransferError):
                c.open_segment(server.address, timeout_s=5)
        assert refused and acc._thread.is_alive()
        with TransferEngine("tcp", secret=SECRET, serve=False) as c:
            assert len(c.open_segment(server.address, timeout_s=5).regions) == 1
    finally:
        server.close()


# ---- 5: submit racing close -----------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["submit", "transfer_sync"])
def test_close_during_submit_fails_the_unstarted_requests_and_leaves_nothing_in_flight(how):
    cfg = TcpConfig(connections_per_peer=2, lane_min_bytes=1)
    server, eng = _pair(cfg)
    with server, eng:
        remote = server.register_region(np.ones(1 << 16, np.uint8))
        local = eng.register_region(np.zeros(1 << 16, np.uint8))
        seg = eng.open_segment(server.address)
        lanes = eng._lanes

        def close_then_split(address, items):  # close() runs after the submit's checks, before its lanes start
            eng.close()
            return lanes(address, items)

        eng._lanes = close_then_split
        reqs = [TransferRequest(Op.READ, local.region_id, i * 4096, seg.segment_id, remote.region_id, i * 4096, 4096)
                for i in range(4)]
        if how == "submit":
            st = eng.submit(reqs).wait(10)
        else:
            st = eng.transfer_sync(reqs)
        assert [s.outcome for s in st] == [Outcome.FAILED] * 4
        assert all("closed" in s.reason for s in st), [s.reason for s in st]
        assert eng.inflight_requests == 0


# ---- 6: timeouts are finite ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TIMEOUTS)
@pytest.mark.parametrize("value", [float("inf"), float("nan"), MAX_TIMEOUT_S * 2, 0, -1.0])
def test_config_refuses_timeouts_that_are_not_finite_and_positive(name, value):
    with pytest.raises(ValueError, match=f"TcpConfig.{name} must be a positive number of seconds up to"):
        TcpConfig(**{name: value})


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_longest_timeouts_work_end_to_end(fast_path):
    cfg = TcpConfig(fast_path=fast_path, **{n: MAX_TIMEOUT_S for n in TIMEOUTS})
    server, client = _pair(cfg)
    with server, client:
        src = fill_pattern(1 << 16, 9)
        out = np.zeros(1 << 16, np.uint8)
        remote, local = server.register_region(src), client.register_region(out)
        seg = client.open_segment(server.address)
        client.read(local, 0, seg, remote.region_id, 0, 1 << 16)
        assert np.array_equal(out, src)
        assert server.backend.server._acceptor._thread.is_alive()


# ---- 7: the peer helper's commands ---------------------------------------------------------------------------

def test_peer_answers_bad_crc_commands_with_an_error_and_keeps_serving():
    with PeerProcess(4096, secret=SECRET, seed=1, timeout_s=20) as p:
        assert "outside the region of 4096 bytes" in p.ask("crc 4000 1000")["error"]
        for bad in ("crc -5 10", "crc x 1", "crc 1", "crc 1 2 3"):
            assert "two non-negative integers" in p.ask(bad)["error"], bad
        assert p.ask("crc 4000 96") == {"crc": crc32c.crc32c(fill_pattern(4096, 1)[4000:].tobytes())}
        assert p.proc.poll() is None


def test_peer_that_exited_is_reported_as_exited():
    with PeerProcess(4096, secret=SECRET, seed=1, timeout_s=20) as p:
        p.proc.stdin.close()  # EOF: the peer stops cleanly
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"exited \(code 0\)"):
            p._line(20)
        assert time.monotonic() - t0 < 10
