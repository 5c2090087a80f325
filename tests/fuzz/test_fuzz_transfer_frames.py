"""Fuzz targets: the transfer protocol's frame decoders, and a live server fed hostile bytes.

Run with the normal budget by ``make test`` and with a large one by ``make fuzz``
(``HYPOTHESIS_PROFILE=fuzz``; ``QUILLCACHE_FUZZ_EXAMPLES`` sets the examples per target), like
``test_fuzz_parsers``. Inputs mix plain random bytes with structure-aware mutations of valid frames
(fields overwritten, bytes flipped, truncated, appended, spliced), so the fuzzer gets past the magic.

- ``decode_request``/``decode_response``: ``ProtocolError`` naming the fault, or a header that
  re-encodes to exactly the bytes given and respects the length limits;
- ``decode_regions``: ``ProtocolError``, or regions whose fields are in range and round-trip;
- ``decode_hello``/``decode_proof``/``decode_accept``: ``ProtocolError``/``AuthenticationError``, or a
  frame that re-encodes to exactly the bytes given (for a proof or accept, the genuine frame: no forged
  frame is accepted);
- live: bytes of any shape written to an in-process server after the real HMAC handshake never crash
  or hang it: it closes that connection by the time the writer half-closes (never holding it past its
  progress timeout), leaves no connection or region use behind, and a well-formed client on its own
  connection is served correctly after every example.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.transfer import AuthenticationError, ProtocolError, RemoteRegion, TcpConfig, TransferEngine
from quillcache.transfer import protocol as P

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
SECRET = b"quillcache-fuzz-transfer-secret-0123456789"


def _mutate(draw, frame: bytes) -> bytes:
    base = bytearray(frame)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "append", "splice", "overwrite"]))
        if op == "flip" and base:
            i = draw(st.integers(0, len(base) - 1))
            base[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del base[draw(st.integers(0, len(base))):]
        elif op == "append":
            base += draw(st.binary(max_size=48))
        elif op == "splice" and len(base) > 2:
            i = draw(st.integers(0, len(base) - 1))
            base[i:i] = draw(st.binary(max_size=16))
        elif op == "overwrite" and base:
            i = draw(st.integers(0, len(base) - 1))
            chunk = draw(st.binary(min_size=1, max_size=8))
            base[i:i + len(chunk)] = chunk
    return bytes(base)


@st.composite
def request_frames(draw) -> bytes:
    op = draw(st.sampled_from(list(P.Opcode)))
    data = op in (P.Opcode.READ, P.Opcode.WRITE)
    frame = P.encode_request(op, draw(st.integers(0, U64)),
                             draw(st.integers(0, U32)) if data else 0,
                             draw(st.sampled_from([0, 1, 4096, U64])) if data else 0,
                             draw(st.sampled_from([1, 64, 1 << 20, 1 << 31, U64])) if data else 0)
    return _mutate(draw, frame)


@st.composite
def response_frames(draw) -> bytes:
    status = draw(st.sampled_from(list(P.Status)))
    length = draw(st.sampled_from([0, 1, P.MAX_REASON_BYTES, P.MAX_REASON_BYTES + 1, U64]))
    return _mutate(draw, P.RESPONSE.pack(P.RESPONSE_MAGIC, P.PROTOCOL_VERSION, int(status), 0,
                                         draw(st.integers(0, U64)), length))


@settings(suppress_health_check=_SUPPRESS)
@given(frame=st.one_of(request_frames(), st.binary(max_size=80)), max_length=st.sampled_from([1, 4096, 1 << 30, U64]))
def test_fuzz_decode_request(frame, max_length):
    try:
        h = P.decode_request(frame, max_length)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert P.encode_request(h.opcode, h.request_id, h.region_id, h.offset, h.length, h.flags) == frame
    if h.opcode in (P.Opcode.READ, P.Opcode.WRITE):
        assert 0 < h.length <= max_length
    else:
        assert h.region_id == h.offset == h.length == 0
    assert h.flags == 0


@settings(suppress_health_check=_SUPPRESS)
@given(frame=st.one_of(response_frames(), st.binary(max_size=60)))
def test_fuzz_decode_response(frame):
    try:
        h = P.decode_response(frame)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert P.encode_response(h.status, h.request_id, h.length) == frame
    assert h.status is P.Status.OK or h.length <= P.MAX_REASON_BYTES


_ENTRY_VALUES = st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=6), st.binary(max_size=6), st.booleans(),
                          st.none(), st.floats(allow_nan=True), st.lists(st.integers(-2**63, 2**64 - 1), max_size=3))


@st.composite
def region_bodies(draw) -> bytes:
    entries = []
    for _ in range(draw(st.integers(0, 5))):
        entry = [draw(st.integers(0, U32)), draw(st.integers(0, U64)), draw(st.text(max_size=10)), draw(st.booleans())]
        for _ in range(draw(st.integers(0, 2))):
            which = draw(st.integers(0, 4))
            if which < 4:
                entry[which] = draw(_ENTRY_VALUES)
            else:
                entry.append(draw(_ENTRY_VALUES))
        entries.append(entry)
    outer = entries if draw(st.integers(0, 9)) else {"regions": entries}
    return _mutate(draw, P.msgpack.packb(outer))


@settings(suppress_health_check=_SUPPRESS)
@given(body=st.one_of(region_bodies(), st.binary(max_size=120)))
def test_fuzz_decode_regions(body):
    try:
        regions = P.decode_regions(body)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert isinstance(regions, tuple)
    for r in regions:
        assert isinstance(r, RemoteRegion)
        assert 0 <= r.region_id <= U32 and r.length_bytes >= 0
        assert isinstance(r.name, str) and isinstance(r.writable, bool)
    assert P.decode_regions(P.encode_regions(list(regions))) == regions


_S_NONCE, _C_NONCE = b"s" * 32, b"c" * 32
_PROOF = P.encode_proof(_C_NONCE, P.client_proof(SECRET, _S_NONCE, _C_NONCE))
_ACCEPT = P.encode_accept(P.server_proof(SECRET, _S_NONCE, _C_NONCE))


@st.composite
def handshake_frames(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["hello", "proof", "accept"]))
    frame = bytearray({"hello": P.encode_hello(_S_NONCE), "proof": _PROOF, "accept": _ACCEPT}[kind])
    if draw(st.booleans()):  # the version and the padding after it (bytes 4-7), where a lone change is likeliest
        frame[draw(st.integers(4, 7))] = draw(st.integers(0, 255))
    return kind, _mutate(draw, bytes(frame)) if draw(st.integers(0, 4)) else draw(st.binary(max_size=90))


@settings(suppress_health_check=_SUPPRESS)
@given(case=handshake_frames())
def test_fuzz_decode_handshake(case):
    kind, frame = case
    try:
        # an accepted frame is exactly its re-encoding (every padding byte zero); a proof or accept only the genuine one
        if kind == "hello":
            nonce = P.decode_hello(frame)
            assert len(nonce) == 32 and frame == P.encode_hello(nonce)
        elif kind == "proof":
            assert P.decode_proof(frame, SECRET, _S_NONCE) == _C_NONCE
            assert frame == _PROOF
        else:
            assert P.decode_accept(frame, SECRET, _S_NONCE, _C_NONCE) is None
            assert frame == _ACCEPT
    except (ProtocolError, AuthenticationError) as exc:
        assert str(exc)


# ---- live: hostile bytes to an in-process server after the real handshake ----------------------------------------

_REGION_BYTES = 65536
_GOOD = bytes(range(256)) * 16  # 4 KiB, read-only: no fuzzed WRITE can change what the good client reads


@pytest.fixture(scope="module")
def live_server():
    config = TcpConfig(progress_timeout_s=1.0, auth_timeout_s=2.0, max_request_bytes=_REGION_BYTES)
    server = TransferEngine("tcp", secret=SECRET, config=config)
    good = TransferEngine("tcp", secret=SECRET, serve=False)
    try:
        target = server.register_region(bytearray(_REGION_BYTES))  # region 1: the fuzz's WRITEs land here
        server.register_region(bytes(4096))                        # region 2: read-only
        served = server.register_region(_GOOD)                      # region 3: what the good client checks
        local = bytearray(len(_GOOD))
        ldesc = good.register_region(local)
        seg = good.open_segment(server.address)
        yield server, target, good, local, ldesc, seg, served
        server.unregister_region(target, timeout_s=1)  # no fuzzed request left it in use
    finally:
        good.close()
        server.close()


@st.composite
def live_streams(draw) -> bytes:
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["read", "write", "list", "ping", "mutated", "random"]))
        rid = draw(st.integers(0, U64))
        region = draw(st.sampled_from([1, 2, 3, 0, 99, U32]))
        offset = draw(st.sampled_from([0, 1, 4095, _REGION_BYTES - 1, _REGION_BYTES, U64]))
        length = draw(st.sampled_from([1, 17, 4096, _REGION_BYTES, _REGION_BYTES + 1]))
        if kind == "read":
            chunks.append(P.encode_request(P.Opcode.READ, rid, region, offset, length))
        elif kind == "write":
            body = draw(st.binary(max_size=64))
            if body and draw(st.booleans()):  # often the whole payload, else a part of it
                body = (body * (length // len(body) + 1))[:length]
            chunks.append(P.encode_request(P.Opcode.WRITE, rid, region, offset, length) + body)
        elif kind in ("list", "ping"):
            chunks.append(P.encode_request(P.Opcode.LIST if kind == "list" else P.Opcode.PING, rid, 0, 0, 0))
        elif kind == "mutated":
            chunks.append(draw(request_frames()))
        else:
            chunks.append(draw(st.binary(max_size=100)))
    return b"".join(chunks)


def _handshake(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    nonce = P.decode_hello(_recv_exact(sock, P.HELLO.size))
    client_nonce = P.new_nonce()
    sock.sendall(P.encode_proof(client_nonce, P.client_proof(SECRET, nonce, client_nonce)))
    P.decode_accept(_recv_exact(sock, P.ACCEPT.size), SECRET, nonce, client_nonce)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


@settings(suppress_health_check=_SUPPRESS, max_examples=max(10, settings().max_examples // 10))
@given(stream=live_streams())
def test_fuzz_live_server_survives_hostile_streams(live_server, stream):
    server, target, good, local, ldesc, seg, served = live_server
    srv = server.backend.server
    sock = _handshake(server.address)
    eof = threading.Event()

    def drain() -> None:  # read whatever the server answers, so it never stalls on us, until it closes
        with contextlib.suppress(OSError):
            sock.settimeout(15)
            while sock.recv(1 << 16):
                pass
        eof.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with contextlib.suppress(OSError):  # the server may close before it has read everything
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        # EOF or a refusal closes it at once; a frame it was still reading ends at our half-close
        assert eof.wait(10), f"the server held a hostile connection open: {stream[:80]!r}"
    finally:
        sock.close()
        reader.join(10)
    deadline = time.monotonic() + 5
    while srv.connections() > 1:  # only the good client's connection stays
        assert time.monotonic() < deadline, "the server kept a closed hostile connection"
        time.sleep(0.001)
    local[:] = bytes(len(local))
    good.read(ldesc, 0, seg, served.region_id, 0, len(_GOOD), timeout_s=10)
    assert local == _GOOD
