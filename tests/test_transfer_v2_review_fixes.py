"""Regression tests for the review of transfer protocol version 2 (each fails without its fix).

1. The compiled ``FastChannel.answer`` completes a canonical version-2 answer itself (``OK``, not a
   ``MISMATCH`` left to the Python checks), and a header saying version 1 is refused by the fast path and
   the plain one alike; a build of ``_fastio`` for another protocol version is not used.
2. A READ/WRITE answer or request whose padding is not zero is refused naming the padding, by the client
   (plain and compiled paths, the compiled one already in ``answer``) and by the server.
3. A LIST answer whose padding is not zero is refused naming it.
4. A version-1 server (a 40-byte HELLO) is refused at once naming its version, by the TCP client and the
   RDMA control connection, not after the peer's authentication timeout.
5. A HELLO, PROOF or ACCEPT whose bytes 5-7 (the padding after the version) are not zero is refused.
6. ``pretouch`` writes one byte in every page a buffer spans, its last page included when the buffer
   does not start on a page (an alignment below one page).

Fake peers are threads on loopback sockets, joined (and their sockets closed) before each test returns.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.alloc import buffers
from quillcache.alloc.buffers import PAGE_BYTES, aligned_empty
from quillcache.transfer import ProtocolError, RemoteRegion, TcpConfig, TransferEngine, TransferError
from quillcache.transfer import protocol as P
from quillcache.transfer import rdma_control
from quillcache.transfer.backends.sockets import Channel, fast_channel
from quillcache.transfer.backends.tcp_client import TcpClient, _Conn
from test_transfer_faults import _raw_session, _recv_exact  # a hand-made client past the real handshake

SECRET = "quillcache-transfer-v2-review-secret-0123"
DATA = bytes(range(64))

try:
    from quillcache.transfer.backends import _fastio
except ImportError:
    _fastio = None
needs_fast = pytest.mark.skipif(_fastio is None, reason="the compiled FastChannel is not built (make install)")


@contextlib.contextmanager
def _tcp_pair():
    """A connected (a, b) pair of TCP sockets on 127.0.0.1; both closed on exit."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        a = socket.create_connection(ls.getsockname()[:2])
        b, _ = ls.accept()
    with a, b:
        yield a, b


def _read_answer(use_fast: bool, header: bytes, rid: int) -> bytes:
    """Feed ``header`` + 64 data bytes to a client connection and read it as the answer to READ ``rid``."""
    with _tcp_pair() as (a, b):
        ch = Channel(b, 2.0, 0)
        conn = _Conn(ch, "peer:1", fast_channel(ch, TcpConfig()) if use_fast else None)
        assert (conn.fast is not None) == use_fast
        a.sendall(header + DATA)
        view = memoryview(bytearray(len(DATA)))
        deadline = time.monotonic() + 5
        if use_fast:
            code = conn.fast.answer(conn.hbuf, view, rid, deadline)
            if code:
                TcpClient._fast_failed(conn, code, rid, view, True, len(DATA), deadline)
        else:
            TcpClient._answer(conn, rid, view, True, len(DATA), deadline)
        return bytes(view)


# ---- 1. the compiled path speaks version 2 --------------------------------------------------------------------

@needs_fast
def test_the_fast_path_completes_a_canonical_version_2_answer_itself():
    assert _fastio.PROTOCOL_VERSION == P.PROTOCOL_VERSION
    with _tcp_pair() as (a, b):
        fast = _fastio.FastChannel(b, 2.0, 0)
        for rid in (7, 8):  # twice: the first answer left nothing behind in the socket
            a.sendall(P.encode_response(P.Status.OK, rid, len(DATA)) + DATA)
            body = bytearray(len(DATA))
            assert fast.answer(bytearray(P.RESPONSE.size), body, rid, time.monotonic() + 5) == _fastio.OK
            assert fast.got == P.RESPONSE.size + len(DATA) and bytes(body) == DATA


@pytest.mark.parametrize("use_fast", [pytest.param(True, marks=needs_fast), False])
def test_a_version_1_answer_header_is_refused_on_both_paths(use_fast):
    header = bytearray(P.encode_response(P.Status.OK, 9, len(DATA)))
    header[4] = 1
    if use_fast:
        with _tcp_pair() as (a, b):
            a.sendall(bytes(header) + DATA)
            fast = _fastio.FastChannel(b, 2.0, 0)
            assert fast.answer(bytearray(64), bytearray(64), 9, time.monotonic() + 5) == _fastio.MISMATCH
    with pytest.raises(ProtocolError, match="protocol version 1"):
        _read_answer(use_fast, bytes(header), 9)


# ---- 2. padding on the data path ------------------------------------------------------------------------------

@pytest.mark.parametrize("use_fast", [pytest.param(True, marks=needs_fast), False])
@pytest.mark.parametrize("where", [24, 40, 63])
def test_a_read_answer_with_nonzero_padding_is_refused_naming_the_padding(use_fast, where):
    assert _read_answer(use_fast, P.encode_response(P.Status.OK, 5, len(DATA)), 5) == DATA  # canonical: taken
    header = bytearray(P.encode_response(P.Status.OK, 5, len(DATA)))
    header[where] = 0x42
    if use_fast:  # the compiled check itself leaves such a header to the Python checks
        with _tcp_pair() as (a, b):
            a.sendall(bytes(header) + DATA)
            fast = _fastio.FastChannel(b, 2.0, 0)
            assert fast.answer(bytearray(64), bytearray(64), 5, time.monotonic() + 5) == _fastio.MISMATCH
    with pytest.raises(ProtocolError, match="padding"):
        _read_answer(use_fast, bytes(header), 5)


def _handshake(address: str) -> socket.socket:
    return _raw_session(address, SECRET)


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_server_refuses_a_read_request_with_nonzero_padding(fast_path):
    region = bytes(range(256)) * 16
    with TransferEngine("tcp", secret=SECRET, config=TcpConfig(fast_path=fast_path)) as server:
        desc = server.register_region(region)
        with _handshake(server.address) as sock:
            sock.sendall(P.encode_request(P.Opcode.READ, 1, desc.region_id, 0, 128))  # canonical: served
            assert P.decode_response(_recv_exact(sock, P.RESPONSE.size)) == P.ResponseHeader(P.Status.OK, 1, 128)
            assert _recv_exact(sock, 128) == region[:128]
            req = bytearray(P.encode_request(P.Opcode.READ, 2, desc.region_id, 0, 128))
            req[-1] = 0xEE
            sock.sendall(bytes(req))
            resp = P.decode_response(_recv_exact(sock, P.RESPONSE.size))
            assert resp.status is P.Status.BAD_FRAME
            assert b"padding" in _recv_exact(sock, resp.length)
        assert server.backend.server.stats.protocol_errors == 1


# ---- 3. LIST padding; 4. a version-1 server ---------------------------------------------------------------------

@contextlib.contextmanager
def _fake_server(serve):
    """A one-connection server thread running ``serve(sock, done)``; ``done`` is set (and the thread joined) on
    exit, so a fake peer that holds its connection open lets go as soon as the test is over."""
    done = threading.Event()
    ls = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with contextlib.suppress(OSError):
            s, _ = ls.accept()
            with s:
                serve(s, done)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield ls.getsockname()[1]
    finally:
        done.set()
        ls.close()
        t.join(10)
        assert not t.is_alive()


def _list_server(pad_byte: int):
    def serve(s: socket.socket, done: threading.Event) -> None:
        sn = P.new_nonce()
        s.sendall(P.encode_hello(sn))
        cn = P.decode_proof(_recv_exact(s, P.PROOF.size), SECRET.encode(), sn)
        s.sendall(P.encode_accept(P.server_proof(SECRET.encode(), sn, cn)))
        req = P.decode_request(_recv_exact(s, P.REQUEST.size), 1 << 30)
        body = P.encode_regions([RemoteRegion(1, 4096, "r", True)])
        pad = bytes([pad_byte]) * P.padding_bytes(len(body))
        assert pad, "the body should not be a multiple of 64 bytes for this test to mean something"
        s.sendall(P.encode_response(P.Status.OK, req.request_id, len(body)) + body + pad)
        done.wait(10)
    return serve


def test_a_list_answer_with_nonzero_padding_is_refused_naming_it():
    with TransferEngine("tcp", secret=SECRET, serve=False) as client:
        with _fake_server(_list_server(0)) as port:  # canonical: taken
            seg = client.open_segment(f"127.0.0.1:{port}", timeout_s=5)
            assert [r.region_id for r in seg.regions] == [1]
        with _fake_server(_list_server(0xAB)) as port:
            with pytest.raises(ProtocolError, match="region list padding"):
                client.open_segment(f"127.0.0.1:{port}", timeout_s=5)


def _v1_server(s: socket.socket, done: threading.Event) -> None:
    s.sendall(b"QCTH\x01\0\0\0" + P.new_nonce())  # a version-1 HELLO: 40 bytes, then it waits for a proof
    done.wait(10)


def test_the_tcp_client_names_a_version_1_server_at_once():
    with TransferEngine("tcp", secret=SECRET, serve=False) as client, _fake_server(_v1_server) as port:
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="hello protocol version 1"):
            client.open_segment(f"127.0.0.1:{port}", timeout_s=5)
        assert time.monotonic() - t0 < 2.5  # not the peer's authentication timeout, nor ours


def test_the_rdma_control_connection_names_a_version_1_server_at_once():
    with _fake_server(_v1_server) as port:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="hello protocol version 1"):
            rdma_control.connect_peer("127.0.0.1", port, SECRET.encode(), connect_timeout_s=2, auth_timeout_s=2,
                                      progress_s=2, deadline=time.monotonic() + 5)
        assert time.monotonic() - t0 < 1.5


# ---- 5. handshake padding after the version ---------------------------------------------------------------------

@pytest.mark.parametrize("where", [5, 6, 7])
def test_handshake_frames_with_nonzero_bytes_after_the_version_are_refused(where):
    key, sn, cn = b"k", b"s" * 32, b"c" * 32
    cases = [
        (P.encode_hello(sn), P.decode_hello),
        (P.encode_proof(cn, P.client_proof(key, sn, cn)), lambda f: P.decode_proof(f, key, sn)),
        (P.encode_accept(P.server_proof(key, sn, cn)), lambda f: P.decode_accept(f, key, sn, cn)),
    ]
    for frame, decode in cases:
        decode(frame)  # the canonical frame is accepted
        bad = bytearray(frame)
        bad[where] = 0x01
        with pytest.raises(ProtocolError, match="bytes 5-7"):
            decode(bytes(bad))


# ---- 6. pretouch reaches every page ----------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(address=st.integers(0, 1 << 40), n=st.integers(0, 5 * PAGE_BYTES + 3))
def test_touch_offsets_hit_every_page_spanned_once(address, n):
    offsets = buffers._touch_offsets(address, n)
    assert all(0 <= o < n for o in offsets) and list(offsets) == sorted(set(offsets.tolist()))
    spanned = set(range(address // PAGE_BYTES, (address + n - 1) // PAGE_BYTES + 1)) if n else set()
    touched = [(address + int(o)) // PAGE_BYTES for o in offsets]
    assert sorted(touched) == sorted(spanned)  # each page once


@pytest.mark.parametrize("pool_offset, align, n", [(100, 64, 3 * PAGE_BYTES), (0, 4096, 3 * PAGE_BYTES),
                                                   (4000, 1, PAGE_BYTES + 200), (17, 16, 1 << 16)])
def test_pretouch_writes_a_byte_in_every_page_the_buffer_spans(pool_offset, align, n):
    pool = aligned_empty(n + 2 * PAGE_BYTES)
    pool[:] = 0xFF

    def make(size, dtype):  # a "fresh" array at a chosen offset into a page, so where the buffer starts is known
        assert dtype == np.uint8
        return pool[pool_offset:pool_offset + size]

    out = buffers._aligned(make, n, align, True)
    addr = out.ctypes.data
    assert addr % align == 0 and out.nbytes == n
    written = np.flatnonzero(out == 0)
    pages = {(addr + int(i)) // PAGE_BYTES for i in written}
    assert pages == set(range(addr // PAGE_BYTES, (addr + n - 1) // PAGE_BYTES + 1))
    assert len(written) == len(pages)  # one write per page
