"""What the cluster layer stores in etcd: segment descriptors, membership events, the leader record.

Invariants:
- A ``SegmentDescriptor`` names one node's memory segment: ``endpoint`` (``"host:port"``) and
  ``transport`` (a transfer backend's name) say how to reach it, ``regions`` what it serves (unique
  ``region_id``s, each with a positive ``length_bytes``), ``capacity_bytes`` how much it offers (at
  least the regions' sum). Construction validates every field; ``from_bytes(to_bytes(d)) == d``.
- Values are msgpack maps with a format version ``v``; a value that does not decode raises
  ``DescriptorError`` naming the field, never returns a half-filled record.
- Keys live under one prefix (``DEFAULT_PREFIX``): nodes at ``{prefix}/nodes/{node_id}``, the
  leader of election ``name`` at ``{prefix}/election/{name}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgpack

from quillcache._checks import check_int
from quillcache.types import NodeId

__all__ = ["DEFAULT_PREFIX", "DescriptorError", "LeaderInfo", "MembershipEvent", "RegionInfo", "SegmentDescriptor",
           "check_endpoint", "election_key", "node_key", "nodes_prefix"]

DEFAULT_PREFIX = "/quillcache"
_FORMAT = 1


class DescriptorError(ValueError):
    """A descriptor field or an encoded value that is not valid (the message names it)."""


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 256 or "/" in value or not value.isprintable():
        raise DescriptorError(f"{what} must be a printable str of 1-256 characters without '/', got {value!r}")
    return value


def check_endpoint(endpoint: object, what: str = "endpoint") -> str:
    """``"host:port"`` with a port in [1, 65535]."""
    if isinstance(endpoint, str):
        host, sep, port = endpoint.rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536 and " " not in host:
            return endpoint
    raise DescriptorError(f"{what} must be 'host:port' with a port in [1, 65535], got {endpoint!r}")


def _prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
        raise ValueError(f"key prefix must start with '/' and not end with one, got {prefix!r}")
    return prefix


def nodes_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{_prefix(prefix)}/nodes/"


def node_key(node_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    return nodes_prefix(prefix) + _check_name("node_id", node_id)


def election_key(name: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{_prefix(prefix)}/election/{_check_name('election name', name)}"


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """A registered memory region of a segment (the transfer engine's ``region_id`` and size)."""

    region_id: int
    length_bytes: int

    def __post_init__(self) -> None:
        check_int("region_id", self.region_id, 0, error=DescriptorError, type_error=DescriptorError)
        check_int("length_bytes", self.length_bytes, 1, error=DescriptorError, type_error=DescriptorError)


@dataclass(frozen=True, kw_only=True)
class SegmentDescriptor:
    """One node's segment as the registry publishes it (see the module invariants)."""

    node_id: NodeId
    endpoint: str
    transport: str
    regions: tuple[RegionInfo, ...] = ()
    capacity_bytes: int = 0

    def __post_init__(self) -> None:
        _check_name("node_id", self.node_id)
        check_endpoint(self.endpoint)
        _check_name("transport", self.transport)
        regions = tuple(self.regions)
        if not all(isinstance(r, RegionInfo) for r in regions):
            raise DescriptorError(f"regions must be RegionInfo records, got {regions!r}")
        ids = [r.region_id for r in regions]
        if len(set(ids)) != len(ids):
            raise DescriptorError(f"region ids must be unique, got {sorted(ids)}")
        object.__setattr__(self, "regions", regions)
        total = sum(r.length_bytes for r in regions)
        check_int("capacity_bytes", self.capacity_bytes, total, error=DescriptorError, type_error=DescriptorError)

    @property
    def registered_bytes(self) -> int:
        return sum(r.length_bytes for r in self.regions)

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": _FORMAT, "node_id": self.node_id, "endpoint": self.endpoint,
                              "transport": self.transport, "capacity_bytes": self.capacity_bytes,
                              "regions": [[r.region_id, r.length_bytes] for r in self.regions]})

    @classmethod
    def from_bytes(cls, data: bytes) -> SegmentDescriptor:
        m = _unpack(data, "segment descriptor")
        try:
            regions = tuple(RegionInfo(region_id=rid, length_bytes=size) for rid, size in m["regions"])
            return cls(node_id=NodeId(m["node_id"]), endpoint=m["endpoint"], transport=m["transport"],
                       regions=regions, capacity_bytes=m["capacity_bytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise DescriptorError(f"segment descriptor does not decode: {type(e).__name__}: {e}") from None


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """Who leads an election: the candidate, where it listens, and its epoch (the key's create revision)."""

    candidate_id: str
    address: str
    epoch: int

    @staticmethod
    def encode(candidate_id: str, address: str) -> bytes:
        """The leader key's value (deterministic bytes: the epoch fence compares them)."""
        return msgpack.packb({"v": _FORMAT, "candidate_id": candidate_id, "address": address})

    @classmethod
    def decode(cls, data: bytes, epoch: int) -> LeaderInfo:
        """The record ``encode`` wrote; DescriptorError naming the field when ``candidate_id`` is not a
        non-empty str, the address not ``host:port``, or a field is missing."""
        m = _unpack(data, "leader record")
        try:
            candidate_id, address = m["candidate_id"], m["address"]
        except KeyError as e:
            raise DescriptorError(f"leader record lacks {e}") from None
        if not isinstance(candidate_id, str) or not candidate_id:
            raise DescriptorError(f"leader record's candidate_id must be a non-empty str, got {candidate_id!r:.80}")
        return cls(candidate_id=candidate_id, address=check_endpoint(address, "leader address"), epoch=epoch)


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """A node joined, changed its descriptor, or left (unregistered, or its lease expired).

    ``segment`` is the new descriptor (join/update) or the last one known (leave); ``revision``
    orders events (etcd's revision, or the in-memory registry's sequence number)."""

    kind: Literal["join", "update", "leave"]
    node_id: NodeId
    segment: SegmentDescriptor | None
    revision: int


def _unpack(data: bytes, what: str) -> dict:
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for damaged input
        raise DescriptorError(f"{what} is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict) or m.get("v") != _FORMAT:
        raise DescriptorError(f"{what} is not a version-{_FORMAT} map: {m!r:.120}")
    return m
