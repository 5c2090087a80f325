"""The TCP transfer protocol, version 2: explicitly packed little-endian frames on 64-byte stream offsets.

Alignment (what version 2 changed from version 1, which packed frames without padding): every fixed
frame is zero-padded to a multiple of ``STREAM_ALIGN_BYTES`` (64), and so is a LIST body, so a
payload starts at a 64-byte offset of its TCP stream whenever the payloads before it on that
connection were multiples of 64 bytes long (KV blocks are). The kernel's copy between the socket and
a page-aligned region (``quillcache.alloc.buffers``) then keeps source and destination on the same
cache-line offset; on the CPUs this project is measured on, a payload behind version 1's 24-byte
response header was copied markedly slower (the transfer study's alignment rows). Padding (the ``x``
bytes of the formats below, the ``3x`` after a handshake frame's version included) is zero when sent
and refused when not zero (an accepted frame is the one its encoder makes). A refusal's reason is not
padded: the connection closes after it.

Frames (``struct`` formats, sizes in bytes):

- request, 64: ``<4s B B H Q I I Q Q 24x`` = magic ``b"QCTR"``, version, opcode, flags, request id,
  region id, reserved (0), offset, length, padding. A WRITE request is followed by exactly
  ``length`` payload bytes.
- response, 64: ``<4s B B H Q Q 40x`` = magic ``b"QCTS"``, version, status, reserved (0), request id,
  length, padding. It comes BEFORE any READ data (``length`` data bytes follow when status is OK),
  after a WRITE only once its bytes are in the server's memory (``length`` 0), after LIST with a
  msgpack body of ``length`` bytes followed by ``padding_bytes(length)`` zero bytes, and with a UTF-8
  reason of ``length`` bytes when status is not OK.
- authentication (before anything else on a connection): the server sends HELLO (64:
  ``<4s B 3x 32s 24x`` = ``b"QCTH"``, version, server nonce); the client answers PROOF (128:
  ``<4s B 3x 32s 32s 56x`` = ``b"QCTA"``, version, client nonce, HMAC-SHA256(secret, "client" ‖
  server nonce ‖ client nonce)); the server checks it in constant time and answers ACCEPT (64:
  ``b"QCTK"``, version, HMAC-SHA256(secret, "server" ‖ client nonce ‖ server nonce)) or closes.
  Both sides prove the secret; neither reveals it; nonces are fresh per connection, so a recorded
  exchange cannot be replayed. A server that cannot keep the connection (its slots are full, or it
  dropped this unauthenticated connection to make room for a newer one) sends, in place of HELLO or
  ACCEPT, a response frame with status BUSY and a reason, then closes; nothing has been requested
  yet, so the client may retry on a fresh connection.

A server handles the requests of one connection in order; a client may have several in flight on
one connection and matches each response to its request by the request id. Any frame that breaks
these rules raises ``ProtocolError`` naming what was wrong; the connection it came on is closed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Callable

import msgpack

from quillcache.transfer.types import AuthenticationError, ProtocolError, RemoteRegion

__all__ = [
    "ACCEPT",
    "FRAME_HEAD_BYTES",
    "HELLO",
    "HandshakeRefused",
    "MAX_LIST_BYTES",
    "MAX_REASON_BYTES",
    "PADDING_BYTES",
    "PROOF",
    "PROTOCOL_VERSION",
    "STREAM_ALIGN_BYTES",
    "REQUEST",
    "RESPONSE",
    "Opcode",
    "RequestHeader",
    "ResponseHeader",
    "Status",
    "check_frame_head",
    "client_proof",
    "decode_accept",
    "decode_hello",
    "decode_proof",
    "decode_regions",
    "decode_request",
    "decode_response",
    "encode_accept",
    "encode_hello",
    "encode_proof",
    "encode_regions",
    "encode_request",
    "encode_response",
    "new_nonce",
    "padding_bytes",
    "read_handshake_frame",
    "server_proof",
]

PROTOCOL_VERSION = 2
STREAM_ALIGN_BYTES = 64
REQUEST = struct.Struct("<4sBBHQIIQQ24x")
RESPONSE = struct.Struct("<4sBBHQQ40x")
HELLO = struct.Struct("<4sB3x32s24x")
PROOF = struct.Struct("<4sB3x32s32s56x")
ACCEPT = struct.Struct("<4sB3x32s24x")
assert all(f.size % STREAM_ALIGN_BYTES == 0 for f in (REQUEST, RESPONSE, HELLO, PROOF, ACCEPT))
# each frame's trailing zero padding (bytes), checked by its decoder: an accepted frame is the canonical one
PADDING_BYTES = {REQUEST: 24, RESPONSE: 40, HELLO: 24, PROOF: 56, ACCEPT: 24}
assert all(f.format.endswith(f"{n}x") for f, n in PADDING_BYTES.items())  # each format's trailing `Nx`
# every frame begins with its magic and version in its first FRAME_HEAD_BYTES (the `3x` of a handshake frame, the
# status and reserved field of a response, the opcode and flags of a request): what a peer reads first
FRAME_HEAD_BYTES = 8
REQUEST_MAGIC, RESPONSE_MAGIC = b"QCTR", b"QCTS"
HELLO_MAGIC, PROOF_MAGIC, ACCEPT_MAGIC = b"QCTH", b"QCTA", b"QCTK"
NONCE_BYTES = 32
MAX_REASON_BYTES = 4096
MAX_LIST_BYTES = 1 << 20
U32_MAX, U64_MAX = (1 << 32) - 1, (1 << 64) - 1


class Opcode(enum.IntEnum):
    """Request opcodes: READ and WRITE match ``types.Op``; LIST asks for the served regions; PING is a no-op."""

    READ = 0
    WRITE = 1
    LIST = 2
    PING = 3


class Status(enum.IntEnum):
    """Response status codes; anything but OK carries a reason and ends the connection."""

    OK = 0
    NO_REGION = 1
    OUT_OF_RANGE = 2
    READ_ONLY = 3
    TOO_LARGE = 4
    BAD_FRAME = 5
    SHUTTING_DOWN = 6
    BUSY = 7  # during authentication only: the server has no slot for this connection now (retry)


@dataclass(frozen=True)
class RequestHeader:
    opcode: Opcode
    request_id: int
    region_id: int
    offset: int
    length: int
    flags: int = 0


@dataclass(frozen=True)
class ResponseHeader:
    status: Status
    request_id: int
    length: int


def encode_request(opcode: Opcode, request_id: int, region_id: int, offset: int, length: int, flags: int = 0) -> bytes:
    """Pack a request header; fields out of their widths raise ``ProtocolError`` (never ``struct.error``)."""
    if not (0 <= int(opcode) <= 0xFF and 0 <= request_id <= U64_MAX and 0 <= region_id <= U32_MAX
            and 0 <= offset <= U64_MAX and 0 <= length <= U64_MAX and 0 <= flags <= 0xFFFF):
        raise ProtocolError(f"request fields out of range: opcode={int(opcode)} id={request_id} region={region_id} "
                            f"offset={offset} length={length} flags={flags}")
    return REQUEST.pack(REQUEST_MAGIC, PROTOCOL_VERSION, int(opcode), flags, request_id, region_id, 0, offset, length)


def _check_padding(kind: str, frame: bytes | bytearray | memoryview, fmt: struct.Struct) -> None:
    pad = PADDING_BYTES[fmt]
    if any(memoryview(frame)[len(frame) - pad:]):
        raise ProtocolError(f"{kind} padding (its last {pad} bytes) must be zero")
    if fmt in (HELLO, PROOF, ACCEPT) and any(memoryview(frame)[5:FRAME_HEAD_BYTES]):
        raise ProtocolError(f"{kind} padding after the version (bytes 5-7) must be zero")


def _check_magic(kind: str, magic: bytes, expected: bytes, version: int) -> None:
    if magic != expected:
        raise ProtocolError(f"bad {kind} magic {magic!r} (expected {expected!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported {kind} protocol version {version} (this side speaks {PROTOCOL_VERSION})")


def check_frame_head(kind: str, head: bytes | bytearray | memoryview, expected: bytes) -> None:
    """Check the magic and version in the first ``FRAME_HEAD_BYTES`` of a frame before reading the rest of it:
    a peer of another protocol version, whose frames have other sizes (version 1's HELLO is 40 bytes), is
    refused naming its version instead of waited on for bytes it will never send."""
    if len(head) < FRAME_HEAD_BYTES:
        raise ProtocolError(f"{kind} head is {len(head)} bytes, expected {FRAME_HEAD_BYTES}")
    _check_magic(kind, bytes(head[:4]), expected, head[4])


class HandshakeRefused(Exception):
    """The server sent a refusal (a non-OK response frame with its reason) in place of a handshake frame."""

    def __init__(self, status: Status, reason: str) -> None:
        super().__init__(f"{status.name}: {reason}")
        self.status, self.reason = status, reason


def read_handshake_frame(recv: Callable[[int], bytes | bytearray | memoryview], kind: str, fmt: struct.Struct,
                         magic: bytes, where: str) -> bytes:
    """The server's next handshake frame (``kind``, of format ``fmt``, magic ``magic``), read with ``recv(n)``
    (exactly ``n`` bytes). Its magic and version are checked first (``check_frame_head``): a server of another
    protocol version raises ``ProtocolError`` naming that version. A response frame in its place is a refusal:
    ``HandshakeRefused`` with the server's status and reason (at most ``MAX_REASON_BYTES``). An OK one is no
    refusal: ``ProtocolError``, nothing more read (its length is unbounded and comes from a peer that has not
    proved the secret). ``where`` names the server in errors."""
    head = bytes(recv(FRAME_HEAD_BYTES))  # magic and version: the frame's size depends on them
    is_response = head[:4] == RESPONSE_MAGIC
    try:
        check_frame_head("response" if is_response else kind, head, RESPONSE_MAGIC if is_response else magic)
    except ProtocolError as e:
        raise ProtocolError(f"{where}: {e}") from None
    if not is_response:
        return head + bytes(recv(fmt.size - FRAME_HEAD_BYTES))
    resp = decode_response(head + bytes(recv(RESPONSE.size - FRAME_HEAD_BYTES)))
    if resp.status is Status.OK:
        raise ProtocolError(f"{where} answered OK in place of a handshake frame")
    reason = bytes(recv(resp.length)).decode("utf-8", "replace") if resp.length else ""
    raise HandshakeRefused(resp.status, reason)


def decode_request(frame: bytes | bytearray | memoryview, max_length: int) -> RequestHeader:
    """Unpack and validate a request header; ``max_length`` bounds the length field of READ/WRITE."""
    if len(frame) != REQUEST.size:
        raise ProtocolError(f"request header is {len(frame)} bytes, expected {REQUEST.size}")
    magic, version, opcode, flags, request_id, region_id, reserved, offset, length = REQUEST.unpack(frame)
    _check_magic("request", magic, REQUEST_MAGIC, version)
    _check_padding("request", frame, REQUEST)
    try:
        op = Opcode(opcode)
    except ValueError:
        raise ProtocolError(f"unknown opcode {opcode} in request {request_id}") from None
    if reserved or flags:
        raise ProtocolError(f"request {request_id} sets reserved bits (flags={flags:#x}, reserved={reserved:#x})")
    if op in (Opcode.READ, Opcode.WRITE):
        if length == 0:
            raise ProtocolError(f"request {request_id}: zero-length {op.name}")
        if length > max_length:
            raise ProtocolError(f"request {request_id}: length {length} exceeds the server's limit {max_length}")
    elif length or offset or region_id:
        raise ProtocolError(f"request {request_id}: {op.name} carries region/offset/length fields")
    return RequestHeader(op, request_id, region_id, offset, length, flags)


def encode_response(status: Status, request_id: int, length: int) -> bytes:
    return RESPONSE.pack(RESPONSE_MAGIC, PROTOCOL_VERSION, int(status), 0, request_id, length)


def decode_response(frame: bytes | bytearray | memoryview) -> ResponseHeader:
    """Unpack and validate a response header (the caller checks the id and the length it expects)."""
    if len(frame) != RESPONSE.size:
        raise ProtocolError(f"response header is {len(frame)} bytes, expected {RESPONSE.size}")
    magic, version, status, reserved, request_id, length = RESPONSE.unpack(frame)
    _check_magic("response", magic, RESPONSE_MAGIC, version)
    _check_padding("response", frame, RESPONSE)
    try:
        st = Status(status)
    except ValueError:
        raise ProtocolError(f"unknown status {status} in response {request_id}") from None
    if reserved:
        raise ProtocolError(f"response {request_id} sets reserved bits")
    if st is not Status.OK and length > MAX_REASON_BYTES:
        raise ProtocolError(f"response {request_id}: reason of {length} bytes exceeds {MAX_REASON_BYTES}")
    return ResponseHeader(st, request_id, length)


def padding_bytes(length: int) -> int:
    """Zero bytes that follow a LIST body of ``length`` bytes on the wire (to the next 64-byte offset)."""
    return -length % STREAM_ALIGN_BYTES


def encode_regions(regions: list[RemoteRegion]) -> bytes:
    return msgpack.packb([[r.region_id, r.length_bytes, r.name, r.writable] for r in regions])


def decode_regions(body: bytes) -> tuple[RemoteRegion, ...]:
    """The LIST answer; anything but a list of ``[id, length, name, writable]`` raises ``ProtocolError``."""
    try:
        items = msgpack.unpackb(body)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"region list is not msgpack: {e}") from None
    out = []
    if not isinstance(items, list):
        raise ProtocolError(f"region list must be a list, got {type(items).__name__}")
    for it in items:
        if not (isinstance(it, list) and len(it) == 4 and type(it[0]) is int and type(it[1]) is int
                and isinstance(it[2], str) and isinstance(it[3], bool) and 0 <= it[0] <= U32_MAX and it[1] >= 0):
            raise ProtocolError(f"malformed region entry {it!r}")
        out.append(RemoteRegion(it[0], it[1], it[2], it[3]))
    return tuple(out)


# ---- authentication -------------------------------------------------------------------------------------------

def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"server" + client_nonce + server_nonce, hashlib.sha256).digest()


def encode_hello(server_nonce: bytes) -> bytes:
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, server_nonce)


def decode_hello(frame: bytes) -> bytes:
    if len(frame) != HELLO.size:
        raise ProtocolError(f"hello is {len(frame)} bytes, expected {HELLO.size}")
    magic, version, nonce = HELLO.unpack(frame)
    _check_magic("hello", magic, HELLO_MAGIC, version)
    _check_padding("hello", frame, HELLO)
    return nonce


def encode_proof(client_nonce: bytes, mac: bytes) -> bytes:
    return PROOF.pack(PROOF_MAGIC, PROTOCOL_VERSION, client_nonce, mac)


def decode_proof(frame: bytes, secret: bytes, server_nonce: bytes) -> bytes:
    """Check a client's proof; returns its nonce or raises ``AuthenticationError``/``ProtocolError``."""
    if len(frame) != PROOF.size:
        raise ProtocolError(f"proof is {len(frame)} bytes, expected {PROOF.size}")
    magic, version, client_nonce, mac = PROOF.unpack(frame)
    _check_magic("proof", magic, PROOF_MAGIC, version)
    _check_padding("proof", frame, PROOF)
    if not hmac.compare_digest(mac, client_proof(secret, server_nonce, client_nonce)):
        raise AuthenticationError("the peer's proof does not match the shared secret")
    return client_nonce


def encode_accept(mac: bytes) -> bytes:
    return ACCEPT.pack(ACCEPT_MAGIC, PROTOCOL_VERSION, mac)


def decode_accept(frame: bytes, secret: bytes, server_nonce: bytes, client_nonce: bytes) -> None:
    if len(frame) != ACCEPT.size:
        raise ProtocolError(f"accept is {len(frame)} bytes, expected {ACCEPT.size}")
    magic, version, mac = ACCEPT.unpack(frame)
    _check_magic("accept", magic, ACCEPT_MAGIC, version)
    _check_padding("accept", frame, ACCEPT)
    if not hmac.compare_digest(mac, server_proof(secret, server_nonce, client_nonce)):
        raise AuthenticationError("the server's proof does not match the shared secret")
