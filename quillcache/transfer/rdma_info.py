"""The RDMA backend's queue-pair information record: what two peers exchange to connect an RC QP.

Version 1, explicitly packed little-endian ``struct`` formats, no implicit padding:

- header, 36 bytes: ``<4s B B H I I 16s H H`` = magic ``b"QCRQ"``, version, path MTU (the sender's
  active MTU as an ``ibv_mtu`` code, 1 = 256 B … 5 = 4096 B), LID, QP number, first PSN, GID (16
  raw bytes, network order, as ``ibv_gid.raw``), region count, reserved (0);
- then one entry per region, 32 bytes: ``<I I Q Q I I`` = region id, flags (bit 0: writable),
  address (the MR's virtual address), length, rkey, reserved (0).

A record is exactly ``36 + 32 × count`` bytes. ``decode_qp_info`` accepts nothing else: a wrong
magic, version or size, an MTU code outside 1..5, a QP number outside 2..2²⁴−1 (0 and 1 are the
special QPs), a PSN over 24 bits, a non-zero reserved field, an unknown flag bit, an empty region,
an address of 0 or a range past 2⁶⁴, a duplicate region id, or more regions than the reader allows
raises ``ProtocolError`` naming the field; ``encode_qp_info`` refuses the same values (never a raw
``struct.error``). The record carries no secret: the control connection it travels on is
authenticated first (``protocol``'s HMAC challenge-response), and an rkey is only usable from the
QP it was exchanged with.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from quillcache.transfer.types import ProtocolError

__all__ = [
    "FLAG_WRITABLE",
    "HEADER",
    "MAX_REGIONS",
    "MTU_BYTES",
    "QP_INFO_MAGIC",
    "QP_INFO_VERSION",
    "REGION",
    "ZERO_GID",
    "QpInfo",
    "RegionKey",
    "decode_qp_info",
    "encode_qp_info",
    "gid_from_str",
    "gid_to_str",
    "read_region_count",
]

QP_INFO_MAGIC = b"QCRQ"
QP_INFO_VERSION = 1
HEADER = struct.Struct("<4sBBHII16sHH")
REGION = struct.Struct("<IIQQII")
FLAG_WRITABLE = 0x1
MAX_REGIONS = 0xFFFF  # the header's count is 16 bits
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu
U16, U24, U32, U64 = (1 << 16) - 1, (1 << 24) - 1, (1 << 32) - 1, (1 << 64) - 1
ZERO_GID = bytes(16)
_HEX = frozenset("0123456789abcdefABCDEF")

assert HEADER.size == 36 and REGION.size == 32


@dataclass(frozen=True)
class RegionKey:
    """One registered region as a peer may address it: where its MR starts, how long, and its rkey."""

    region_id: int
    addr: int
    length_bytes: int
    rkey: int
    writable: bool = True


@dataclass(frozen=True)
class QpInfo:
    """What one side tells the other to bring an RC QP to RTS, plus the regions it serves."""

    qp_num: int
    psn: int
    lid: int
    gid: bytes
    mtu: int
    regions: tuple[RegionKey, ...] = ()

    def region(self, region_id: int) -> RegionKey | None:
        for r in self.regions:
            if r.region_id == region_id:
                return r
        return None


def _check_header_fields(qp_num: int, psn: int, lid: int, gid: object, mtu: int) -> None:
    if type(mtu) is not int or mtu not in MTU_BYTES:
        raise ProtocolError(f"QP info: MTU code {mtu!r} is not an ibv_mtu (1..5)")
    if type(qp_num) is not int or not 2 <= qp_num <= U24:
        raise ProtocolError(f"QP info: QP number {qp_num!r} outside 2..{U24}")
    if type(psn) is not int or not 0 <= psn <= U24:
        raise ProtocolError(f"QP info: PSN {psn!r} is not a 24-bit number")
    if type(lid) is not int or not 0 <= lid <= U16:
        raise ProtocolError(f"QP info: LID {lid!r} is not a 16-bit number")
    if not isinstance(gid, (bytes, bytearray)) or len(gid) != 16:
        raise ProtocolError(f"QP info: GID must be 16 bytes, got {gid!r}")


def _check_region(r: object, seen: set[int]) -> RegionKey:
    if not isinstance(r, RegionKey):
        raise ProtocolError(f"QP info: a region must be a RegionKey, got {type(r).__name__}")
    if type(r.region_id) is not int or not 0 <= r.region_id <= U32:
        raise ProtocolError(f"QP info: region id {r.region_id!r} is not a 32-bit number")
    if r.region_id in seen:
        raise ProtocolError(f"QP info: region {r.region_id} listed twice")
    if type(r.length_bytes) is not int or not 1 <= r.length_bytes <= U64:
        raise ProtocolError(f"QP info: region {r.region_id} has length {r.length_bytes!r}")
    if type(r.addr) is not int or not 1 <= r.addr <= U64 or r.addr + r.length_bytes - 1 > U64:
        raise ProtocolError(f"QP info: region {r.region_id} at address {r.addr!r} of {r.length_bytes} bytes "
                            "does not fit in 64 bits")
    if type(r.rkey) is not int or not 0 <= r.rkey <= U32:
        raise ProtocolError(f"QP info: region {r.region_id} rkey {r.rkey!r} is not a 32-bit number")
    if not isinstance(r.writable, bool):
        raise ProtocolError(f"QP info: region {r.region_id} writable must be a bool")
    seen.add(r.region_id)
    return r


def encode_qp_info(info: QpInfo) -> bytes:
    """Pack ``info``; any field out of its width or range raises ``ProtocolError``."""
    if not isinstance(info, QpInfo):
        raise ProtocolError(f"encode_qp_info takes a QpInfo, got {type(info).__name__}")
    _check_header_fields(info.qp_num, info.psn, info.lid, info.gid, info.mtu)
    if len(info.regions) > MAX_REGIONS:
        raise ProtocolError(f"QP info: {len(info.regions)} regions exceed the record's limit of {MAX_REGIONS}")
    seen: set[int] = set()
    parts = [HEADER.pack(QP_INFO_MAGIC, QP_INFO_VERSION, info.mtu, info.lid, info.qp_num, info.psn,
                         bytes(info.gid), len(info.regions), 0)]
    for r in info.regions:
        r = _check_region(r, seen)
        parts.append(REGION.pack(r.region_id, FLAG_WRITABLE if r.writable else 0, r.addr, r.length_bytes,
                                 r.rkey, 0))
    return b"".join(parts)


def _unpack_header(header: bytes | bytearray | memoryview) -> tuple:
    if len(header) < HEADER.size:
        raise ProtocolError(f"QP info is {len(header)} bytes, shorter than its {HEADER.size}-byte header")
    magic, version, mtu, lid, qp_num, psn, gid, count, reserved = HEADER.unpack_from(header)
    if magic != QP_INFO_MAGIC:
        raise ProtocolError(f"bad QP info magic {bytes(magic)!r} (expected {QP_INFO_MAGIC!r})")
    if version != QP_INFO_VERSION:
        raise ProtocolError(f"unsupported QP info version {version} (this side speaks {QP_INFO_VERSION})")
    if reserved:
        raise ProtocolError(f"QP info sets reserved header bits ({reserved:#x})")
    _check_header_fields(qp_num, psn, lid, gid, mtu)
    return mtu, lid, qp_num, psn, bytes(gid), count


def read_region_count(header: bytes | bytearray | memoryview, max_regions: int = MAX_REGIONS) -> int:
    """Validate a record's 36-byte header alone; return how many 32-byte region entries follow.

    A stream reader calls this on the header, then reads ``count × REGION.size`` more bytes, so it
    never reads an unbounded amount on a peer's word.
    """
    if len(header) != HEADER.size:
        raise ProtocolError(f"QP info header is {len(header)} bytes, expected {HEADER.size}")
    count = _unpack_header(header)[-1]
    if count > max_regions:
        raise ProtocolError(f"QP info lists {count} regions, more than the {max_regions} allowed")
    return count


def decode_qp_info(data: bytes | bytearray | memoryview, max_regions: int = MAX_REGIONS) -> QpInfo:
    """Unpack and validate a whole record; anything malformed raises ``ProtocolError``."""
    mtu, lid, qp_num, psn, gid, count = _unpack_header(data)
    if count > max_regions:
        raise ProtocolError(f"QP info lists {count} regions, more than the {max_regions} allowed")
    expected = HEADER.size + count * REGION.size
    if len(data) != expected:
        raise ProtocolError(f"QP info is {len(data)} bytes; a record with {count} regions is {expected}")
    regions = []
    seen: set[int] = set()
    for i in range(count):
        rid, flags, addr, length, rkey, reserved = REGION.unpack_from(data, HEADER.size + i * REGION.size)
        if reserved:
            raise ProtocolError(f"QP info: region {rid} sets reserved bits ({reserved:#x})")
        if flags & ~FLAG_WRITABLE:
            raise ProtocolError(f"QP info: region {rid} has unknown flags {flags:#x}")
        regions.append(_check_region(RegionKey(rid, addr, length, rkey, bool(flags & FLAG_WRITABLE)), seen))
    return QpInfo(qp_num, psn, lid, gid, mtu, tuple(regions))


def gid_to_str(gid: bytes) -> str:
    """16 raw GID bytes → pyverbs' ``'xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx'`` form."""
    if not isinstance(gid, (bytes, bytearray)) or len(gid) != 16:
        raise ValueError(f"a GID is 16 bytes, got {gid!r}")
    h = bytes(gid).hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def gid_from_str(text: str) -> bytes:
    """pyverbs' 8-group GID string (``GID.gid``) → 16 raw bytes; anything else raises ``ValueError``."""
    groups = text.split(":") if isinstance(text, str) else []
    if len(groups) != 8 or any(len(g) != 4 or not all(c in _HEX for c in g) for g in groups):
        raise ValueError(f"not a GID in 8 groups of 4 hex digits: {text!r}")
    return bytes.fromhex("".join(groups))
