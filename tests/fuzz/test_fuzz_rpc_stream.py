"""Fuzz targets: the RPC layer's request handling and the plain-TCP transport (``qtcp://``) fed hostile bytes.

Run with the normal budget by ``make test`` and with a large one by ``make fuzz`` (``HYPOTHESIS_PROFILE=fuzz``).
Inputs mix random bytes with structure-aware mutations of valid request frames (flipped, truncated, appended,
spliced), under length prefixes that are right, short, long or past the limits.

- ``Dispatcher.handle``: any body gives exactly one reply that ``parse_reply`` accepts (never an exception);
- live: any byte stream written to a ``StreamServer`` gets only well-formed replies, at most one per 4 bytes (a length prefix), and
  the connection ends by the time the writer half-closes; the server keeps no connection of it, and a good client
  on its own connection is served correctly after every example.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.rpc import Codec, RpcClient, StreamServer
from quillcache.rpc.dispatch import Dispatcher
from quillcache.rpc.wire import encode_request, parse_reply

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
LEN = struct.Struct(">I")
MAX_FRAME = 4096
DROP_FRAME = 16384
CODEC = Codec()


class Target:
    def add(self, a: int, b: int = 0) -> int:
        return a + b

    def echo(self, value: object) -> object:
        return value

    def fail(self) -> None:
        raise ValueError("fails")


METHODS = ["add", "echo", "fail"]


def _mutate(draw, frame: bytes) -> bytes:
    base = bytearray(frame)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "append", "splice"]))
        if op == "flip" and base:
            i = draw(st.integers(0, len(base) - 1))
            base[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del base[draw(st.integers(0, len(base))):]
        elif op == "append":
            base += draw(st.binary(max_size=32))
        elif op == "splice" and len(base) > 2:
            i = draw(st.integers(0, len(base) - 1))
            base[i:i] = draw(st.binary(max_size=16))
    return bytes(base)


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["valid", "mutated", "random", "msgpack"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    if kind == "msgpack":
        value = draw(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8)
                                  | st.binary(max_size=8), lambda c: st.lists(c, max_size=5)
                                  | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=12))
        return msgpack.packb(value)
    frame = encode_request(CODEC, draw(st.integers(0, 2**64 - 1)), draw(st.sampled_from(METHODS + ["nope", "_x"])),
                           draw(st.lists(st.integers(-5, 5), max_size=3)), {})
    return frame if kind == "valid" else _mutate(draw, frame)


@settings(suppress_health_check=_SUPPRESS)
@given(body=bodies())
def test_fuzz_dispatcher_answers_every_body(body):
    dispatcher = Dispatcher(Target(), METHODS, CODEC, MAX_FRAME)
    rid, ok, payload = parse_reply(CODEC, dispatcher.handle(body))
    assert ok or isinstance(payload, dict)


@st.composite
def streams(draw) -> tuple[bytes, int]:
    """(bytes, number of length prefixes in them)."""
    chunks, frames = [], 0
    for _ in range(draw(st.integers(1, 6))):
        body = draw(bodies())
        length = draw(st.sampled_from(["right", "right", "short", "long", "over_max", "over_drop"]))
        n = {"right": len(body), "short": max(0, len(body) - 3), "long": len(body) + 5,
             "over_max": MAX_FRAME + 1, "over_drop": DROP_FRAME + 1}[length]
        chunks.append(LEN.pack(n) + body)
        frames += 1
        if draw(st.booleans()):
            chunks.append(draw(st.binary(max_size=24)))  # bytes between frames
    return b"".join(chunks), frames


@pytest.fixture(scope="module")
def live():
    server = StreamServer(Target(), METHODS, codec=CODEC, max_frame_bytes=MAX_FRAME, drop_frame_bytes=DROP_FRAME)
    server.start()
    good = RpcClient(server.address, timeout_s=10.0, codec=CODEC)
    try:
        yield server, good
    finally:
        good.close()
        server.close()


@settings(suppress_health_check=_SUPPRESS, max_examples=max(10, settings().max_examples // 4))
@given(case=streams())
def test_fuzz_live_stream_server_survives_hostile_streams(live, case):
    server, good = live
    stream, frames = case
    assert good.add(1, 2) == 3  # the good client's connection exists before the hostile one
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    received = bytearray()
    eof = threading.Event()

    def drain() -> None:
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                received.extend(chunk)
        eof.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        with contextlib.suppress(OSError):  # the server may close before it has read everything
            sock.sendall(stream)
            sock.shutdown(socket.SHUT_WR)
        assert eof.wait(10), f"the server held a hostile connection open: {stream[:80]!r}"
    finally:
        reader.join(10)
        sock.close()
    replies, at = 0, 0
    while at < len(received):
        (n,) = LEN.unpack_from(received, at)
        rid, ok, payload = parse_reply(CODEC, bytes(received[at + 4:at + 4 + n]))
        assert ok or isinstance(payload, dict)
        at, replies = at + 4 + n, replies + 1
    # a short length or stray bytes make more frames than were meant; each reply still answers >= 4 bytes read
    assert at == len(received) and replies <= len(stream) // 4, (replies, frames, stream[:80])
    deadline = time.monotonic() + 5
    while server.num_connections > 1:  # only the good client's connection stays
        assert time.monotonic() < deadline, "the server kept a closed hostile connection"
        time.sleep(0.001)
    assert good.echo([b"x", "y"]) == [b"x", "y"]
