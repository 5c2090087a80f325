"""The transfer engine's vocabulary: operations, outcomes, region and segment descriptors, requests, errors.

Shaped like Mooncake's Transfer Engine (``registerLocalMemory`` → ``openSegment`` →
``submitTransfer(batch, [{opcode, source, target_id, target_offset, length}])`` →
``getTransferStatus``) and NIXL (register, describe, ``initialize_xfer``, ``check_xfer_state``), so
either can become a backend behind the same calls.

Invariants:
- A ``RegionDescriptor`` names bytes that stay where they are: registering copies nothing, and a
  transfer reads from / writes into the registered buffer itself.
- A ``TransferRequest`` is one contiguous range: ``length_bytes`` bytes at ``local_offset_bytes`` of a
  local region and at ``remote_offset_bytes`` of a remote region. READ moves remote → local, WRITE
  local → remote.
- Every request of a submitted batch ends in exactly one terminal ``Outcome`` (COMPLETED, FAILED or
  TIMEOUT); a FAILED or TIMEOUT status carries the reason. COMPLETED for a WRITE means the peer
  acknowledged the bytes after they were in its memory; for a READ, that every byte is in the local
  region.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "AuthenticationError",
    "Op",
    "Outcome",
    "ProtocolError",
    "RegionDescriptor",
    "RegionError",
    "RemoteRegion",
    "RequestStatus",
    "SegmentInfo",
    "TransferError",
    "TransferRequest",
    "TransferTimeoutError",
]


class TransferError(Exception):
    """Base class of every transfer-engine error."""


class RegionError(TransferError, ValueError):
    """A region or range that is not registered, or lies outside its region.

    ``code`` says which: ``no_region``, ``out_of_range``, ``read_only`` (or ``""`` for others).
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ProtocolError(TransferError):
    """A frame that breaks the wire protocol (bad magic, version, opcode, length or order)."""


class AuthenticationError(TransferError):
    """The peer did not prove it holds the cluster's shared secret (or we could not prove it to the peer)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """``wait`` ran past its timeout with requests still in flight, or a sync transfer timed out."""


class Op(enum.IntEnum):
    """What a request does: READ pulls remote bytes into a local region, WRITE pushes local bytes out."""

    READ = 0
    WRITE = 1


class Outcome(enum.Enum):
    """A request's state; the last three are terminal."""

    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"

    @property
    def done(self) -> bool:
        return self is not Outcome.PENDING


@dataclass(frozen=True)
class RegionDescriptor:
    """A registered local buffer: ``region_id`` is what peers name in requests; ``length_bytes`` its size."""

    region_id: int
    length_bytes: int
    name: str = ""
    writable: bool = True


@dataclass(frozen=True)
class RemoteRegion:
    """One region a peer serves, as its ``list regions`` answer describes it."""

    region_id: int
    length_bytes: int
    name: str = ""
    writable: bool = True


@dataclass(frozen=True)
class SegmentInfo:
    """An opened peer segment: where it listens and the regions it serves (Mooncake's ``openSegment``)."""

    segment_id: int
    address: str
    regions: tuple[RemoteRegion, ...]

    def region(self, region_id: int) -> RemoteRegion:
        by_id = self.__dict__.get("_by_id")
        if by_id is None:
            by_id = {r.region_id: r for r in self.regions}
            object.__setattr__(self, "_by_id", by_id)  # a cache; the dataclass stays frozen to its users
        r = by_id.get(region_id)
        if r is not None:
            return r
        raise RegionError(f"peer {self.address} serves no region {region_id} "
                          f"(it serves {[r.region_id for r in self.regions]})")

    def by_name(self, name: str) -> RemoteRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise RegionError(f"peer {self.address} serves no region named {name!r} "
                          f"(it serves {[r.name for r in self.regions]})")


@dataclass(frozen=True)
class TransferRequest:
    """One contiguous transfer; see the module docstring for the direction of each ``Op``."""

    op: Op
    local_region: int
    local_offset_bytes: int
    segment: int
    remote_region: int
    remote_offset_bytes: int
    length_bytes: int


class RequestStatus(NamedTuple):
    """Where one request of a batch stands; ``reason`` says why for FAILED and TIMEOUT."""

    outcome: Outcome
    reason: str = ""
    transferred_bytes: int = 0
