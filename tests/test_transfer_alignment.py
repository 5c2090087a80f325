"""Protocol version 2 keeps payloads on 64-byte offsets of the TCP stream (``protocol.py``, "Alignment").

Checked on the wire with a hand-made client against a real ``TransferEngine`` server: every byte the
server sends before a READ's payload (HELLO, ACCEPT, a LIST answer with its padded body, earlier
answers and payloads) adds up to a multiple of 64, and the padding is zeros. Also the frame sizes,
the padding rule, and that a stale compiled fast path (built for another header size) is not used.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.transfer import TcpConfig, TransferEngine
from quillcache.transfer import protocol as P

SECRET = "alignment-test-secret-000000001"


def test_every_fixed_frame_is_a_multiple_of_the_stream_alignment():
    assert P.STREAM_ALIGN_BYTES == 64 and P.PROTOCOL_VERSION == 2
    for frame in (P.REQUEST, P.RESPONSE, P.HELLO, P.PROOF, P.ACCEPT):
        assert frame.size % 64 == 0, frame.format


@given(st.integers(0, 1 << 40))
def test_padding_reaches_the_next_aligned_offset_and_no_further(n):
    pad = P.padding_bytes(n)
    assert 0 <= pad < 64 and (n + pad) % 64 == 0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"the server closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


def test_payloads_start_on_64_byte_stream_offsets_after_handshake_list_and_earlier_payloads():
    region = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    with TransferEngine("tcp", secret=SECRET, config=TcpConfig()) as server:
        desc = server.register_region(region)
        server.register_region(bytes(100))  # a second region makes the LIST body some odd length
        host, port = server.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
        try:
            received = 0  # bytes of the server-to-client stream so far

            def take(n: int) -> bytes:
                nonlocal received
                received += n
                return _recv_exact(sock, n)

            server_nonce = P.decode_hello(take(P.HELLO.size))
            client_nonce = P.new_nonce()
            sock.sendall(P.encode_proof(client_nonce, P.client_proof(SECRET.encode(), server_nonce, client_nonce)))
            P.decode_accept(take(P.ACCEPT.size), SECRET.encode(), server_nonce, client_nonce)
            sock.sendall(P.encode_request(P.Opcode.LIST, 1, 0, 0, 0))
            resp = P.decode_response(take(P.RESPONSE.size))
            body = take(resp.length)
            assert resp.length % 64, "the LIST body should be an odd length for this test to mean something"
            assert {r.region_id for r in P.decode_regions(body)} >= {desc.region_id}
            assert take(P.padding_bytes(resp.length)) == bytes(P.padding_bytes(resp.length))  # zero padding
            for rid, (offset, length) in enumerate(((0, 4096), (64, 65536), (8192, 2 << 16)), start=2):
                sock.sendall(P.encode_request(P.Opcode.READ, rid, desc.region_id, offset, length))
                resp = P.decode_response(take(P.RESPONSE.size))
                assert resp.status is P.Status.OK and resp.request_id == rid and resp.length == length
                assert received % 64 == 0, f"READ {rid}'s payload starts at stream offset {received}"
                assert take(length) == region[offset:offset + length].tobytes()
        finally:
            sock.close()


@pytest.mark.parametrize("attr, value", [("RESPONSE_HEADER_BYTES", 24),  # what a build of version 1 reports
                                         ("PROTOCOL_VERSION", 1)])  # the header size matches, the version not
def test_a_fast_path_built_for_another_protocol_version_is_not_used(attr, value):
    code = ("import importlib, warnings\n"
            "from quillcache.transfer.backends import _fastio, sockets\n"
            "assert sockets.FastChannel is _fastio.FastChannel\n"  # this build matches
            f"_fastio.{attr} = {value}\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    importlib.reload(sockets)\n"
            "assert sockets.FastChannel is None, sockets.FastChannel\n"
            "assert any('another protocol version' in str(x.message) for x in w), [str(x.message) for x in w]\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_a_frame_with_nonzero_padding_is_refused_naming_the_padding():
    from quillcache.transfer.types import ProtocolError

    cases = [
        (P.encode_request(P.Opcode.READ, 1, 1, 0, 64), lambda f: P.decode_request(f, 1 << 20)),
        (P.encode_response(P.Status.OK, 1, 64), P.decode_response),
        (P.encode_hello(b"n" * 32), P.decode_hello),
        (P.encode_proof(b"c" * 32, P.client_proof(b"k", b"n" * 32, b"c" * 32)),
         lambda f: P.decode_proof(f, b"k", b"n" * 32)),
        (P.encode_accept(P.server_proof(b"k", b"n" * 32, b"c" * 32)),
         lambda f: P.decode_accept(f, b"k", b"n" * 32, b"c" * 32)),
    ]
    for frame, decode in cases:
        decode(frame)  # the canonical frame is accepted
        bad = bytearray(frame)
        bad[-1] = 1
        with pytest.raises(ProtocolError, match="padding"):
            decode(bytes(bad))
