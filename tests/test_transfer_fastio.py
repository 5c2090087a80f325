"""The compiled ``FastChannel`` (``_fastio.pyx``) against its reference, the plain-Python ``Channel``.

What it shows:

- The outcome codes the Python callers map (``tcp_client``, ``tcp_server``) are the module's.
- ``send``/``recv_into`` move the exact bytes, whether they arrive at once, in late pieces (past
  the spin budget: the blocking path), with spinning or not, on a blocking descriptor or on one made
  non-blocking behind its back (then every wait polls).
- One request/answer exchange, scripted byte for byte by a hand-made peer (Hypothesis over the op,
  the data length, how the answer is cut into pieces and what the peer does wrong), gives the same
  result through ``FastChannel.round_trip`` + ``TcpClient._fast_failed`` as through ``Channel.send``
  + ``TcpClient._answer``: the same READ bytes in the destination, or the same exception type (and,
  for a refusal or a malformed answer, the same reason, which comes from the same Python checks):
  an OK answer, a refusal with its reason, a wrong request id / magic / length, a peer that closes
  mid-header or mid-data, or resets the connection.
- A silent peer ends the call with ``socket.timeout`` after ``progress_s`` (no sooner, not much
  later), a nearer deadline ends it at the deadline, a 1-s spin budget included, and a closed peer
  is noticed at once, on both paths.
- ``Channel`` and ``FastChannel`` on one socket agree on the kernel timeout armed (the slow path's
  short deadline is seen by the fast path, which re-arms its own bound).
- End to end, engines with ``fast_path`` on and off on either side move the same random batch of
  READs and WRITEs to the same bytes (crc32c against the source).

Sockets are real TCP connections on 127.0.0.1; a peer pauses (``time.sleep``) only to make bytes
arrive late or to stay silent: that delay is the stimulus, every wait for a result has a deadline.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.transfer import Op, Outcome, TcpConfig, TransferEngine, TransferRequest
from quillcache.transfer import protocol as P
from quillcache.transfer.backends import tcp_client, tcp_server
from quillcache.transfer.backends.sockets import Channel, fast_channel
from quillcache.transfer.backends.tcp_client import TcpClient, _Conn, _Refusal
from quillcache.transfer.types import ProtocolError

_fastio = pytest.importorskip("quillcache.transfer.backends._fastio",
                              reason="the compiled FastChannel is not built (make install)")
FastChannel = _fastio.FastChannel

SECRET = "quillcache-transfer-fastio-tests-secret-01"
LONG_SPIN_US = 1_000_000


@contextlib.contextmanager
def _tcp_pair():
    """A connected (a, b) pair of TCP sockets on 127.0.0.1; both closed on exit."""
    lsock = socket.create_server(("127.0.0.1", 0))
    a = b = None
    try:
        a = socket.create_connection(lsock.getsockname()[:2], timeout=5)
        b, _ = lsock.accept()
        yield a, b
    finally:
        for s in (a, b, lsock):
            if s is not None:
                s.close()


def _send_later(sock: socket.socket, pieces: list[bytes], gap_s: float, then=None) -> threading.Thread:
    def run() -> None:
        with contextlib.suppress(OSError):
            for p in pieces:
                if gap_s:
                    time.sleep(gap_s)
                sock.sendall(p)
            if then is not None:
                then()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_outcome_codes_the_callers_map_are_the_modules():
    assert (_fastio.OK, _fastio.TIMEOUT, _fastio.DEADLINE, _fastio.CLOSED, _fastio.OSERROR, _fastio.MISMATCH) \
        == (0, 1, 2, 3, 4, 5)
    assert (tcp_client._TIMEOUT, tcp_client._DEADLINE, tcp_client._CLOSED, tcp_client._MISMATCH) == (1, 2, 3, 5)
    assert (tcp_server._TIMEOUT, tcp_server._DEADLINE, tcp_server._CLOSED) == (1, 2, 3)


def test_fast_path_false_gives_no_fast_channel():
    with _tcp_pair() as (_, b):
        ch = Channel(b, 5.0)
        assert fast_channel(ch, TcpConfig(fast_path=False)) is None and ch.fast is None
        fast = fast_channel(ch, TcpConfig())
        assert isinstance(fast, FastChannel) and ch.fast is fast
    with pytest.raises(ValueError, match="fast_path"):
        TcpConfig(fast_path=1)


@pytest.mark.parametrize("spin_us", [0, 20, LONG_SPIN_US])
@pytest.mark.parametrize("gap_s", [0.0, 0.02])
@pytest.mark.parametrize("blocking", [True, False])
def test_send_and_recv_move_exact_bytes_early_or_late(spin_us, gap_s, blocking):
    rng = np.random.default_rng(spin_us + int(gap_s * 1000) + blocking)
    data = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    with _tcp_pair() as (a, b):
        fast = FastChannel(b, 5.0, spin_us)
        if not blocking:
            b.setblocking(False)  # behind its back: every wait must poll, and still honour its bounds
        t = _send_later(a, [data[:1000], data[1000:200_000], data[200_000:]], gap_s)
        out = bytearray(len(data))
        assert fast.recv_into(out, time.monotonic() + 10) == _fastio.OK
        t.join(5)
        assert bytes(out) == data and fast.got == len(data)
        # send: a head and a body the peer reads back in full
        head = b"H" * 40
        got = bytearray()

        def drain() -> None:
            a.settimeout(10)
            while len(got) < len(head) + len(data):
                got.extend(a.recv(1 << 20))
        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        assert fast.send(head, memoryview(data), time.monotonic() + 10) == _fastio.OK
        reader.join(10)
        assert bytes(got) == head + data
        if not blocking:  # and a silent peer still costs the whole progress bound, not an instant failure
            fast2 = FastChannel(b, 0.1, spin_us)
            start = time.monotonic()
            assert fast2.recv_into(bytearray(10), time.monotonic() + 10) == _fastio.TIMEOUT
            assert 0.09 < time.monotonic() - start < 1.0


# ---- one exchange, both paths ------------------------------------------------------------------------------

RID = 4242
FAULTS = ("none", "refuse", "wrong_id", "bad_magic", "wrong_length", "close_in_header", "close_in_data", "reset")


def _script(fault: str, is_read: bool, data: bytes) -> tuple[bytes, str]:
    """The bytes a scripted peer answers request ``RID`` with, and what it does after them."""
    n = len(data) if is_read else 0
    if fault == "refuse":
        reason = b"request 4242: range [0, 9) lies outside region 1 of 8 bytes"
        return P.encode_response(P.Status.OUT_OF_RANGE, RID, len(reason)) + reason, "close"
    if fault == "wrong_id":
        return P.encode_response(P.Status.OK, RID + 1, n) + (data if is_read else b""), "stay"
    if fault == "bad_magic":
        return b"XXXX" + P.encode_response(P.Status.OK, RID, n)[4:], "stay"
    if fault == "wrong_length":
        return P.encode_response(P.Status.OK, RID, n + 1), "stay"
    if fault == "close_in_header":
        return P.encode_response(P.Status.OK, RID, n)[:10], "close"
    if fault == "close_in_data":
        return P.encode_response(P.Status.OK, RID, n) + (data[: len(data) // 2] if is_read else b""), "close"
    if fault == "reset":
        return P.encode_response(P.Status.OK, RID, n)[:5], "reset"
    return P.encode_response(P.Status.OK, RID, n) + (data if is_read else b""), "stay"


def _exchange(use_fast: bool, fault: str, is_read: bool, data: bytes, cuts: list[int], gap_s: float):
    """One request/answer on a fresh connection: ('ok', destination bytes) or (exception type, message)."""
    answer, after = _script(fault, is_read, data)
    cuts = sorted({c % (len(answer) + 1) for c in cuts})
    pieces = [answer[i:j] for i, j in zip([0, *cuts], [*cuts, len(answer)]) if j > i]
    dest = bytearray(len(data))
    payload = memoryview(data)
    with _tcp_pair() as (a, b):
        ch = Channel(b, 2.0, 50)
        conn = _Conn(ch, "127.0.0.1:1", fast_channel(ch, TcpConfig(progress_timeout_s=2.0)) if use_fast else None)

        def finish() -> None:
            if after == "close":
                a.shutdown(socket.SHUT_WR)
            elif after == "reset":
                a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                a.close()

        # the peer first swallows the request (header and a WRITE's payload), then answers
        need = P.REQUEST.size + (0 if is_read else len(data))

        def peer() -> None:
            a.settimeout(10)
            seen = 0
            while seen < need:
                k = len(a.recv(1 << 20))
                if not k:
                    return
                seen += k
            _send_later(a, pieces, gap_s, finish).join(10)

        t = threading.Thread(target=peer, daemon=True)
        t.start()
        view = memoryview(dest)
        op = Op.READ if is_read else Op.WRITE
        head = TcpClient._head(op, RID, 1, 0, len(data))
        deadline = time.monotonic() + 10
        try:
            if use_fast:
                code = conn.fast.round_trip(head, None if is_read else payload, conn.hbuf,
                                            view if is_read else None, RID, deadline)
                if code:
                    TcpClient._fast_failed(conn, code, RID, view, is_read, len(data), deadline)
            else:
                ch.send(head, None if is_read else payload, deadline)
                TcpClient._answer(conn, RID, view, is_read, len(data), deadline)
            result = ("ok", bytes(dest) if is_read else b"")
        except (_Refusal, ProtocolError) as e:
            result = (type(e).__name__, str(e))
        except (ConnectionError, OSError) as e:
            result = ("ConnectionError" if isinstance(e, ConnectionError) else "OSError", "")
        t.join(10)
    return result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fault=st.sampled_from(FAULTS), is_read=st.booleans(), n=st.integers(1, 200_000),
       cuts=st.lists(st.integers(0, 1 << 20), max_size=3), late=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_one_exchange_gives_the_same_bytes_or_error_on_both_paths(fault, is_read, n, cuts, late, seed):
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    gap_s = 0.003 if late else 0.0
    fast = _exchange(True, fault, is_read, data, cuts, gap_s)
    ref = _exchange(False, fault, is_read, data, cuts, gap_s)
    if fault == "reset":  # a reset may surface as a reset or as an end of stream, on either path
        assert fast[0] in ("ConnectionError", "OSError") and ref[0] in ("ConnectionError", "OSError")
        return
    assert fast == ref
    if fault == "none":
        assert fast == ("ok", data if is_read else b"")
    elif fault == "refuse":
        assert fast[0] == "_Refusal" and "lies outside region 1" in fast[1]
    elif fault in ("wrong_id", "bad_magic", "wrong_length"):
        assert fast[0] == "ProtocolError"
    elif fault == "close_in_data" and not is_read:
        assert fast == ("ok", b"")  # a WRITE's answer is the header alone: it came whole
    else:
        assert fast[0] == "ConnectionError"


@pytest.mark.parametrize("spin_us", [0, LONG_SPIN_US])
def test_a_silent_peer_times_out_after_progress_and_a_nearer_deadline_first(spin_us):
    with _tcp_pair() as (a, b):
        fast = FastChannel(b, 0.2, spin_us)
        start = time.monotonic()
        assert fast.recv_into(bytearray(10), start + 30) == _fastio.TIMEOUT
        elapsed = time.monotonic() - start
        assert 0.19 < elapsed < 1.5 + spin_us * 1e-6, f"progress bound 0.2 s ended after {elapsed:.3f} s"
        start = time.monotonic()
        assert fast.round_trip(b"x" * 40, None, bytearray(64), bytearray(8), 1, start + 0.05) == _fastio.DEADLINE
        elapsed = time.monotonic() - start
        assert 0.04 < elapsed < 0.5, f"a 0.05-s deadline ended after {elapsed:.3f} s"
        assert fast.recv_into(bytearray(10), time.monotonic() - 1) == _fastio.DEADLINE  # already passed
        assert a.recv(100) == b"x" * 40  # (unread bytes would turn the close below into a reset)
        a.sendall(b"abc")
        closer = threading.Timer(0.05, a.close)
        closer.start()
        start = time.monotonic()
        assert fast.recv_into(bytearray(10), start + 30) == _fastio.CLOSED
        assert time.monotonic() - start < 0.5 and fast.got == 3
        closer.join(5)


def test_channel_and_fast_channel_agree_on_the_armed_kernel_timeout():
    with _tcp_pair() as (a, b):
        ch = Channel(b, 5.0)
        fast = fast_channel(ch, TcpConfig(progress_timeout_s=5.0, spin_us=0))
        assert fast.armed_s == 5.0
        ch.arm(time.monotonic() + 0.5)  # the slow path arms a short bound: the fast path must know
        assert 0 < fast.armed_s <= 0.5

        def kernel_rcvtimeo() -> float:
            sec, usec = struct.unpack("ll", b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
            return sec + usec * 1e-6

        assert kernel_rcvtimeo() == pytest.approx(fast.armed_s, abs=0.01)
        a.sendall(b"z" * 8)
        assert fast.recv_into(bytearray(8), time.monotonic() + 30) == _fastio.OK  # blocks bounded by 5 s again
        assert fast.armed_s == 5.0 and kernel_rcvtimeo() == pytest.approx(5.0, abs=0.01)
        ch.arm(None)  # the Channel learns what the fast path set: nothing to re-arm
        assert ch._armed_s == 5.0


@pytest.mark.parametrize("client_fast, server_fast", [(True, False), (False, True), (False, False)])
def test_engines_with_and_without_the_fast_path_move_the_same_bytes(client_fast, server_fast):
    rng = np.random.default_rng(13 + 2 * client_fast + server_fast)
    size = 4 << 20
    served = rng.integers(0, 256, size, dtype=np.uint8)
    local = rng.integers(0, 256, size, dtype=np.uint8)
    expect_served, expect_local = served.copy(), local.copy()
    with TransferEngine("tcp", secret=SECRET, config=TcpConfig(fast_path=server_fast)) as server, \
            TransferEngine("tcp", secret=SECRET, serve=False, config=TcpConfig(fast_path=client_fast)) as client:
        sdesc = server.register_region(served, name="served")
        ldesc = client.register_region(local, name="local")
        seg = client.open_segment(server.address)
        reqs, spans = [], []
        for i in range(64):  # disjoint ranges: 64 slots of 64 KiB on each side, random length and op
            n = int(rng.integers(1, 64 << 10))
            lo, ro = i * (64 << 10), (63 - i) * (64 << 10)
            op = Op.READ if rng.random() < 0.5 else Op.WRITE
            reqs.append(TransferRequest(op, ldesc.region_id, lo, seg.segment_id, sdesc.region_id, ro, n))
            spans.append((op, lo, ro, n))
        statuses = client.transfer_sync(reqs, timeout_s=30)
        assert all(s.outcome is Outcome.COMPLETED for s in statuses), statuses
        client.read(ldesc, 0, seg, sdesc.region_id, 0, 1000)  # the single-request path too
        for op, lo, ro, n in spans:
            if op is Op.READ:
                expect_local[lo:lo + n] = expect_served[ro:ro + n]
            else:
                expect_served[ro:ro + n] = expect_local[lo:lo + n]
        expect_local[:1000] = expect_served[:1000]
    assert crc32c.crc32c(local) == crc32c.crc32c(expect_local)
    assert crc32c.crc32c(served) == crc32c.crc32c(expect_served)


def test_wait_counters_say_whether_a_wait_spun_paid_or_blocked():
    with _tcp_pair() as (a, b):
        spinning, blocking = FastChannel(b, 5.0, LONG_SPIN_US), FastChannel(b, 5.0, 0)
        t = _send_later(a, [b"late"], 0.02)  # arrives within the 1-s spin budget: the spin pays
        assert spinning.recv_into(bytearray(4), time.monotonic() + 10) == _fastio.OK
        t.join(5)
        c = spinning.counters()
        assert c["spins"] == 1 and c["paid"] + c["preempted"] == 1 and c["blocked"] <= 1, c
        t = _send_later(a, [b"late"], 0.02)
        assert blocking.recv_into(bytearray(4), time.monotonic() + 10) == _fastio.OK
        t.join(5)
        assert blocking.counters() == {"spins": 0, "paid": 0, "preempted": 0, "blocked": 1}


def test_a_server_sums_the_wait_counters_of_its_connections():
    served = np.arange(1 << 16, dtype=np.uint8)
    with TransferEngine("tcp", secret=SECRET) as server, TransferEngine("tcp", secret=SECRET, serve=False) as client:
        sdesc = server.register_region(served)
        local = bytearray(1 << 16)
        ldesc = client.register_region(local)
        seg = client.open_segment(server.address)
        for _ in range(20):
            client.read(ldesc, 0, seg, sdesc.region_id, 0, len(local))
        waits = server.backend.server.wait_counters()
        assert bytes(local) == served.tobytes()
        assert waits["spins"] + waits["blocked"] >= 20, waits  # each request header was waited for once at least


def _congestion(sock: socket.socket) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()


def test_tune_socket_sets_the_first_congestion_control_the_kernel_accepts():
    from quillcache.transfer.backends.sockets import tune_socket

    with socket.socket() as s:
        default = _congestion(s)
    with socket.socket() as s:
        tune_socket(s, TcpConfig(congestion_control=f"no-such-algorithm,{default}"))
        assert _congestion(s) == default  # an unknown name is skipped, the next one taken
    with socket.socket() as s:
        tune_socket(s, TcpConfig(congestion_control=""))
        assert _congestion(s) == default  # "": the system's default
    with socket.socket() as s:
        tune_socket(s, TcpConfig())
        assert _congestion(s) in ("cubic", "reno", default)  # default, unless neither may be set here
    with pytest.raises(ValueError, match="congestion_control"):
        TcpConfig(congestion_control=["cubic"])
