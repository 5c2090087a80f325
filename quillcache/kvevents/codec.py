"""vLLM KV-event wire codec: msgpack ``EventBatch`` payloads in both of vLLM's encodings.

Encodings (vLLM's ``msgspec`` structs, ``vllm/distributed/kv_events.py``):

- ``"tagged"`` (current vLLM: structs as maps, events tagged by a ``"type"`` key)::

      {"ts": float, "events": [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h|None,
        "token_ids": [...], "block_size": int, "lora_id": int|None, "medium": str|None, "lora_name": str|None}, ...],
       "data_parallel_rank": int|None}

- ``"positional"`` (older vLLM: ``array_like`` structs, the tag first)::

      [ts, [["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name],
            ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]], data_parallel_rank]

  Trailing optional fields may be absent (older builds had no ``medium``/``lora_name``; ``omit_defaults``) and
  extra trailing fields (newer builds: ``extra_keys``, ``group_idx``...) are ignored, as are unknown map keys.

:func:`decode_batch` accepts either encoding (and a mix: a map batch with array events or the reverse), hashes as
i64, u64 or digest bytes, and returns a typed :class:`~quillcache.kvevents.types.EventBatch` with hashes in the
u64 form (``types.normalize_hash``). Anything else raises :class:`KvEventDecodeError` naming what was wrong; an
event with an unknown type tag is skipped and counted (``EventBatch.unknown_events``). :func:`check_batch` runs the
same checks on a typed batch (what a publisher must not send). :func:`encode_batch` writes
either encoding with hashes as ``"u64"``, ``"i64"`` or ``"bytes"`` (the stand-in engine uses it; the decoder's
tests use it to exercise every combination).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import msgpack

from quillcache.kvevents.types import (
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    normalize_hash,
)

__all__ = ["ENCODINGS", "HASH_FORMS", "MAX_PAYLOAD_BYTES", "KvEventDecodeError", "check_batch", "decode_batch",
           "encode_batch"]

Encoding = Literal["tagged", "positional"]
HashForm = Literal["u64", "i64", "bytes"]
ENCODINGS: tuple[str, ...] = ("tagged", "positional")
HASH_FORMS: tuple[str, ...] = ("u64", "i64", "bytes")
MAX_PAYLOAD_BYTES = 64 << 20
MAX_TOKEN = (1 << 32) - 1


class KvEventDecodeError(ValueError):
    """A payload that is not a valid vLLM ``EventBatch`` (the message names the field and the event index)."""


# ---------------------------------------------------------------------------------- encode
def _wire_hash(h: int | bytes, form: str) -> int | bytes:
    if isinstance(h, (bytes, bytearray)):
        if form == "bytes":
            return bytes(h)
        h = int.from_bytes(h, "big") & U64_MASK
    h = int(h) & U64_MASK
    if form == "u64":
        return h
    if form == "i64":
        return h - (1 << 64) if h >= 1 << 63 else h
    return h.to_bytes(8, "big")


def _encode_event(ev: Any, encoding: str, form: str) -> Any:
    if isinstance(ev, BlockStored):
        fields = [("block_hashes", [_wire_hash(h, form) for h in ev.block_hashes]),
                  ("parent_block_hash", None if ev.parent_block_hash is None else _wire_hash(ev.parent_block_hash, form)),
                  ("token_ids", list(ev.token_ids)), ("block_size", ev.block_size), ("lora_id", ev.lora_id),
                  ("medium", ev.medium), ("lora_name", ev.lora_name)]
        tag = "BlockStored"
    elif isinstance(ev, BlockRemoved):
        fields = [("block_hashes", [_wire_hash(h, form) for h in ev.block_hashes]), ("medium", ev.medium)]
        tag = "BlockRemoved"
    elif isinstance(ev, AllBlocksCleared):
        fields, tag = [], "AllBlocksCleared"
    else:
        raise TypeError(f"not a KV event: {type(ev).__name__}")
    if encoding == "tagged":
        return {"type": tag, **dict(fields)}
    return [tag, *(v for _, v in fields)]


def encode_batch(batch: EventBatch, *, encoding: Encoding = "tagged", hash_form: HashForm = "u64") -> bytes:
    """msgpack payload of ``batch`` in ``encoding`` with hashes as ``hash_form`` (ValueError lists the choices).
    Hashes in ``batch`` may be u64 ints or digest bytes (``"bytes"`` keeps a digest whole)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown KV-event encoding {encoding!r}; known: {list(ENCODINGS)}")
    if hash_form not in HASH_FORMS:
        raise ValueError(f"unknown hash form {hash_form!r}; known: {list(HASH_FORMS)}")
    events = [_encode_event(ev, encoding, hash_form) for ev in batch.events]
    if encoding == "tagged":
        obj: Any = {"ts": batch.ts, "events": events, "data_parallel_rank": batch.data_parallel_rank}
    else:
        obj = [batch.ts, events, batch.data_parallel_rank]
    return msgpack.packb(obj, use_bin_type=True)


# ---------------------------------------------------------------------------------- decode
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
_STORED_REQUIRED = 4  # block_hashes, parent_block_hash, token_ids, block_size
_REMOVED_FIELDS = ("block_hashes", "medium")
_FIELDS = {"BlockStored": (_STORED_FIELDS, _STORED_REQUIRED), "BlockRemoved": (_REMOVED_FIELDS, 1),
           "AllBlocksCleared": ((), 0)}


def _fields(raw: Any, where: str) -> tuple[str | None, dict[str, Any]]:
    """(tag, {field: value}) of one raw event in either encoding; tag None = unknown type."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventDecodeError(f"{where}: a map event needs a string 'type', got {tag!r:.40}")
        if tag not in _FIELDS:
            return None, {}
        names, required = _FIELDS[tag]
        missing = [n for n in names[:required] if n not in raw]
        if missing:
            raise KvEventDecodeError(f"{where} ({tag}): missing field(s) {missing}")
        return tag, {n: raw.get(n) for n in names}
    if isinstance(raw, (list, tuple)):
        if not raw or not isinstance(raw[0], str):
            raise KvEventDecodeError(f"{where}: an array event must start with its type tag (a string)")
        tag = raw[0]
        if tag not in _FIELDS:
            return None, {}
        names, required = _FIELDS[tag]
        values = list(raw[1:])
        if len(values) < required:
            raise KvEventDecodeError(f"{where} ({tag}): {len(values)} field(s), needs at least {required} "
                                     f"({list(names[:required])})")
        return tag, {n: (values[i] if i < len(values) else None) for i, n in enumerate(names)}
    raise KvEventDecodeError(f"{where}: an event must be a map or an array, got {type(raw).__name__}")


def _hashes(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise KvEventDecodeError(f"{where}: block_hashes must be an array, got {type(value).__name__}")
    try:
        return tuple(normalize_hash(h, field=f"{where}.block_hashes[{i}]") for i, h in enumerate(value))
    except ValueError as e:
        raise KvEventDecodeError(str(e)) from None


def _opt_str(value: Any, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventDecodeError(f"{field} must be a string or nil, got {type(value).__name__}")


def _opt_int(value: Any, field: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvEventDecodeError(f"{field} must be an int or nil, got {type(value).__name__}")


def _event(raw: Any, where: str) -> KvEvent | None:
    tag, f = _fields(raw, where)
    if tag is None:
        return None
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = _hashes(f["block_hashes"], where)
    medium = _opt_str(f["medium"], f"{where}.medium")
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    parent = f["parent_block_hash"]
    if parent is not None:
        try:
            parent = normalize_hash(parent, field=f"{where}.parent_block_hash")
        except ValueError as e:
            raise KvEventDecodeError(str(e)) from None
    bs = f["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise KvEventDecodeError(f"{where}.block_size must be an int >= 1, got {bs!r:.40}")
    tokens = f["token_ids"]
    if not isinstance(tokens, (list, tuple)):
        raise KvEventDecodeError(f"{where}.token_ids must be an array, got {type(tokens).__name__}")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN:
            raise KvEventDecodeError(f"{where}.token_ids[{i}]={t!r:.40} is not a token id in [0, 2**32)")
    if len(tokens) != len(hashes) * bs:
        raise KvEventDecodeError(f"{where}: {len(tokens)} token_ids for {len(hashes)} block(s) of {bs} tokens "
                                 f"(expected {len(hashes) * bs})")
    return BlockStored(hashes, parent, tuple(tokens), bs, _opt_int(f["lora_id"], f"{where}.lora_id"), medium,
                       _opt_str(f["lora_name"], f"{where}.lora_name"))


def _check_ts(ts: Any) -> None:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts:
        raise KvEventDecodeError(f"batch ts must be a number, got {ts!r:.40}")


def check_batch(batch: EventBatch) -> None:
    """``KvEventDecodeError`` (a ``ValueError``) naming the first field of ``batch`` that :func:`decode_batch`
    would refuse (the invariants of :mod:`~quillcache.kvevents.types`: hashes in the i64/u64 range or digest bytes,
    token ids in ``[0, 2**32)``, one ``block_size`` of tokens per block...), ``TypeError`` for what is not an
    ``EventBatch`` of KV events: the decoder's own checks, run on a typed batch before it is published."""
    if not isinstance(batch, EventBatch):
        raise TypeError(f"not an EventBatch: {type(batch).__name__}")
    _check_ts(batch.ts)
    _opt_int(batch.data_parallel_rank, "batch data_parallel_rank")
    if not isinstance(batch.events, (tuple, list)):
        raise TypeError(f"batch events must be a tuple of events, got {type(batch.events).__name__}")
    for i, ev in enumerate(batch.events):
        if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"events[{i}]: not a KV event: {type(ev).__name__}")
        fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}
        _event({"type": type(ev).__name__, **fields}, f"events[{i}]")


def decode_batch(payload: bytes | bytearray | memoryview) -> EventBatch:
    """Typed batch from a msgpack payload in either encoding (module docstring); ``KvEventDecodeError`` otherwise."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise KvEventDecodeError(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KvEventDecodeError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises ValueError subclasses, ExtraData, StackError, FormatError, ...
        raise KvEventDecodeError(f"payload is not msgpack: {type(e).__name__}: {e}"[:300]) from None
    if isinstance(obj, dict):
        missing = [k for k in ("ts", "events") if k not in obj]
        if missing:
            raise KvEventDecodeError(f"batch map is missing {missing}")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    elif isinstance(obj, list):
        if len(obj) < 2:
            raise KvEventDecodeError(f"batch array has {len(obj)} element(s); needs [ts, events, ...]")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise KvEventDecodeError(f"batch must be a map or an array, got {type(obj).__name__}")
    _check_ts(ts)
    if not isinstance(events, list):
        raise KvEventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    rank = _opt_int(rank, "batch data_parallel_rank")
    out: list[KvEvent] = []
    unknown = 0
    for i, raw in enumerate(events):
        ev = _event(raw, f"events[{i}]")
        if ev is None:
            unknown += 1
        else:
            out.append(ev)
    return EventBatch(float(ts), tuple(out), rank, unknown)
