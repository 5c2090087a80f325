"""Argument checks of the master's public calls: each refusal is an ``InvalidParamsError`` naming
the argument, its value and the allowed range (a bad key, size, replica count, pin, digest,
segment descriptor or config never reaches the state machine). Every string a record stores (key,
node id, endpoint, transport) must be valid UTF-8 (a lone surrogate is refused) and every int fit
msgpack, so a checked call's log record can always be encoded."""

from __future__ import annotations

import math

from quillcache._checks import check_float
from quillcache.master.errors import InvalidParamsError
from quillcache.master.types import (
    MAX_DIGEST_BYTES, MAX_DURATION_S, MAX_KEY_CHARS, MAX_REPLICAS, U32_MAX, MasterConfig, PinKind, PutRequest,
    ReplicaConfig, SegmentDescriptor,
)
from quillcache.types import CacheTier

__all__ = ["check_config", "check_duration_s", "check_key", "check_put", "check_put_fields", "check_put_row",
           "check_segment", "key_error", "utf8_ok"]

MAX_NODE_BYTES = 200  # the residency index's limit on node names
_MSGPACK_INT_MIN, _MSGPACK_INT_MAX = -(1 << 63), (1 << 64) - 1  # what the operation log can store


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_duration_s(name: str, value: object, *, zero_ok: bool = False) -> float:
    """``value`` as a float number of seconds in ``(0, MAX_DURATION_S]`` (``[0, ...]`` with ``zero_ok``);
    otherwise ``InvalidParamsError`` (a ``ValueError``) naming ``name``, the value and the range."""
    return check_float(name, value, 0.0, MAX_DURATION_S, lo_open=not zero_ok, error=InvalidParamsError,
                       type_error=InvalidParamsError)


def check_config(c: MasterConfig) -> None:
    if not isinstance(c, MasterConfig):
        raise TypeError(f"config must be a MasterConfig, got {type(c).__name__}")
    for name in ("lease_ttl_s", "client_ttl_s"):
        check_duration_s(f"MasterConfig.{name}", getattr(c, name))
    check_duration_s("MasterConfig.restart_budget_s", c.restart_budget_s, zero_ok=True)
    for name in ("zombie_preempt_s", "zombie_reclaim_s", "soft_pin_ttl_s", "snapshot_every_s"):  # only compared
        v = getattr(c, name)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)):
            raise InvalidParamsError(f"MasterConfig.{name}={v!r} must be a positive finite number of seconds")
    if not 0 < c.high_watermark <= 1 or not 0 < c.evict_fraction <= 1:
        raise InvalidParamsError(f"MasterConfig high_watermark={c.high_watermark} and evict_fraction="
                                 f"{c.evict_fraction} must be in (0, 1]")
    a = c.alignment_bytes
    if not _is_int(a) or a < 1 or a & (a - 1) or a > 1 << 30:
        raise InvalidParamsError(f"MasterConfig.alignment_bytes={a!r} must be a power of two in [1, 2**30]")
    if not _is_int(c.max_object_bytes) or not 1 <= c.max_object_bytes <= U32_MAX:
        raise InvalidParamsError(f"MasterConfig.max_object_bytes={c.max_object_bytes!r} must be in [1, 2**32-1]")
    if not _is_int(c.snapshot_every_records) or c.snapshot_every_records < 1:
        raise InvalidParamsError(f"MasterConfig.snapshot_every_records={c.snapshot_every_records!r} must be >= 1")
    if not _is_int(c.max_forgotten_keys) or not 0 <= c.max_forgotten_keys <= 1 << 30:
        raise InvalidParamsError(f"MasterConfig.max_forgotten_keys={c.max_forgotten_keys!r} must be an int in "
                                 f"[0, 2**30]")
    if not _is_int(c.snapshot_inflight_records) or c.snapshot_inflight_records < 0:
        raise InvalidParamsError(f"MasterConfig.snapshot_inflight_records={c.snapshot_inflight_records!r} must be >= 0")
    for name in ("restart_s_per_object", "restart_s_per_change"):
        v = getattr(c, name)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
            raise InvalidParamsError(f"MasterConfig.{name}={v!r} must be a finite number >= 0")
    if c.restart_budget_s > 0 and c.restart_s_per_change <= 0:
        raise InvalidParamsError("MasterConfig.restart_s_per_change must be > 0 when restart_budget_s is")
    g = c.snapshot_growth
    if not (isinstance(g, (int, float)) and not isinstance(g, bool) and 0 <= g <= 100 and math.isfinite(g)):
        raise InvalidParamsError(f"MasterConfig.snapshot_growth={g!r} must be a number in [0, 100]")
    for name in ("index_on_disk", "sync_put_start", "defer_index_publish"):
        if type(getattr(c, name)) is not bool:
            raise InvalidParamsError(f"MasterConfig.{name}={getattr(c, name)!r} must be a bool")
    if c.epoch is not None and (not _is_int(c.epoch) or c.epoch < 1):
        raise InvalidParamsError(f"MasterConfig.epoch={c.epoch!r} must be a positive int or None")
    from quillcache.master.snapshot_writer import SNAPSHOT_WRITERS  # (the writers import the state, which imports this)
    if not isinstance(c.snapshot_writer, str) or c.snapshot_writer not in SNAPSHOT_WRITERS.names():
        raise InvalidParamsError(f"MasterConfig.snapshot_writer={c.snapshot_writer!r} must be one of "
                                 f"{SNAPSHOT_WRITERS.names()}")


def utf8_ok(s: str) -> bool:
    """Can ``s`` be written as UTF-8 (what the operation log stores)? False for a lone surrogate."""
    if s.isascii():  # (O(1) for a str)
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_key(key: object) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS or not utf8_ok(key):
        shown = f"{key!r:.60}" if isinstance(key, str) else f"{type(key).__name__} {key!r:.60}"
        raise InvalidParamsError(f"key {shown} must be a non-empty str of at most {MAX_KEY_CHARS} characters, "
                                 f"valid UTF-8 (no lone surrogate)")
    return key


def key_error(key: object) -> InvalidParamsError:
    """The error ``check_key`` raises for a bad key (batch calls return it in the key's slot)."""
    try:
        check_key(key)
    except InvalidParamsError as exc:
        return exc
    raise ValueError(f"key {key!r} is valid")


def check_put(req: PutRequest, max_object_bytes: int) -> tuple[str, int, int, int | None, int, bytes | None]:
    """``(key, size_bytes, replica_num, preferred_segment, pin, digest)`` of a valid request."""
    cfg = req.config
    if isinstance(cfg, ReplicaConfig):
        return check_put_fields(req.key, req.size_bytes, cfg.replica_num, cfg.preferred_segment, req.pin,
                                req.digest, max_object_bytes)
    key, _, _, _, _, _ = check_put_fields(req.key, req.size_bytes, 1, None, 0, None, max_object_bytes)
    raise InvalidParamsError(f"put_start({key!r}): config must be a ReplicaConfig, got {type(cfg).__name__}")


def check_put_row(row: object, max_object_bytes: int) -> tuple[str, int, int, int | None, int, bytes | None]:
    """``check_put`` of a compact request row ``[key, size_bytes, replica_num, preferred_segment, pin,
    digest]`` (what ``MasterService.batch_put_start_compact`` takes)."""
    if not isinstance(row, (list, tuple)) or len(row) != 6:
        raise InvalidParamsError(f"a compact put_start row is [key, size_bytes, replica_num, preferred_segment, "
                                 f"pin, digest], got {row!r:.80}")
    return check_put_fields(*row, max_object_bytes)


_PINS = {int(p): int(p) for p in PinKind}


def check_put_fields(key: object, size: object, n: object, preferred: object, pin: object, digest: object,
                     max_object_bytes: int) -> tuple[str, int, int, int | None, int, bytes | None]:
    """The checks of ``check_put`` on the request's fields, in the same order with the same messages."""
    if (type(key) is str and 0 < len(key) <= MAX_KEY_CHARS and key.isascii() and type(size) is int and 0 < size <= max_object_bytes
            and type(n) is int and 1 <= n <= MAX_REPLICAS and preferred is None and digest is None
            and type(pin) in (int, PinKind) and pin in _PINS):  # the common request: every check passes
        return key, size, n, None, _PINS[pin], None
    key = check_key(key)
    if not _is_int(size):
        raise InvalidParamsError(f"put_start({key!r}): size_bytes must be an int, got {type(size).__name__}")
    if not 0 < size <= max_object_bytes:
        raise InvalidParamsError(f"put_start({key!r}): size_bytes={size} must be in [1, {max_object_bytes}]")
    if not _is_int(n) or not 1 <= n <= MAX_REPLICAS:
        raise InvalidParamsError(f"put_start({key!r}): replica_num={n!r} must be an int in [1, {MAX_REPLICAS}]")
    if preferred is not None and not _is_int(preferred):
        raise InvalidParamsError(f"put_start({key!r}): preferred_segment={preferred!r} must be an int")
    p = _PINS.get(pin) if type(pin) in (int, PinKind) else None
    if p is None:
        try:
            p = int(PinKind(pin))
        except (ValueError, TypeError):
            raise InvalidParamsError(f"put_start({key!r}): pin={pin!r} is not a PinKind") from None
    if digest is not None:
        if not isinstance(digest, (bytes, bytearray)) or not 0 < len(digest) <= MAX_DIGEST_BYTES:
            raise InvalidParamsError(f"put_start({key!r}): digest must be 1..{MAX_DIGEST_BYTES} bytes or None")
        digest = bytes(digest)
    return key, size, n, preferred, p, digest


def check_segment(d: object, alignment: int) -> int:
    """Validate a descriptor to mount; returns its tier as an int."""
    if not isinstance(d, SegmentDescriptor):
        raise InvalidParamsError(f"mount_segment takes a SegmentDescriptor, got {type(d).__name__}")
    if not isinstance(d.node_id, str) or not d.node_id or "\x00" in d.node_id or not utf8_ok(d.node_id) \
            or len(d.node_id.encode("utf-8", "surrogatepass")) > MAX_NODE_BYTES:
        raise InvalidParamsError(f"segment node_id={d.node_id!r} must be 1..{MAX_NODE_BYTES} UTF-8 bytes "
                                 f"(no lone surrogate), no NUL")
    if not _is_int(d.segment_id) or not 0 <= d.segment_id <= U32_MAX:
        raise InvalidParamsError(f"segment_id={d.segment_id!r} must be an int in [0, 2**32-1]")
    if not _is_int(d.capacity_bytes) or not alignment <= d.capacity_bytes <= U32_MAX * alignment:
        raise InvalidParamsError(f"segment {d.segment_id}: capacity_bytes={d.capacity_bytes!r} must be an int in "
                                 f"[{alignment}, {U32_MAX * alignment}] (alignment_bytes={alignment})")
    if not isinstance(d.endpoint, str) or not isinstance(d.transport, str) or not utf8_ok(d.endpoint) \
            or not utf8_ok(d.transport) or not all(_is_int(r) and _MSGPACK_INT_MIN <= r <= _MSGPACK_INT_MAX
                                                   for r in d.region_ids):
        raise InvalidParamsError(f"segment {d.segment_id}: endpoint={d.endpoint!r:.60} and transport="
                                 f"{d.transport!r:.60} must be valid UTF-8 str (no lone surrogate), region_ids="
                                 f"{d.region_ids!r:.60} ints in [-2**63, 2**64-1]")
    try:
        return int(CacheTier(d.tier))
    except ValueError:
        raise InvalidParamsError(f"segment {d.segment_id}: tier={d.tier!r} is not a CacheTier") from None
