"""Trace schemas: which fields a trace line may carry and the rule each one must follow.

Every schema is one JSON object per line; each is a superset of the one before it:

- ``mooncake`` (the Mooncake/Kimi release): ``timestamp``, ``input_length``, ``output_length``,
  ``hash_ids`` - all four required on every line, whatever the schema.
- ``generated`` (this project's generated traces, e.g. :mod:`quillcache.traces.sessions`): the
  Mooncake fields plus any of ``block_tokens``, ``tenant``, ``model``, ``tokenizer``, ``adapter``,
  ``kv_dtype``, ``session_id``, ``turn``.
- ``collision`` (:mod:`quillcache.traces.collision`): the generated fields plus
  ``public_prefix_blocks`` and ``intent``.

Invariants enforced by :func:`check_record` (each violation raises :class:`SchemaError` naming the
field, the value and the rule; nothing is guessed or coerced):

- integers are JSON integers (not booleans, floats or strings) inside their stated range;
- ``hash_ids`` is a list of integers in ``[0, 2**64)`` of length ``ceil(input_length / block_tokens)``;
- strings follow the identity rules of :mod:`quillcache.identity.scope` (``""`` = "not given");
  ``kv_dtype`` is ``""`` or a dtype :class:`quillcache.types.KvLayout` accepts;
- ``block_tokens`` of a line wins over the caller's default; a caller's explicit block size that
  disagrees with the line's is an error, not a silent override;
- fields that no schema names are ignored (forward compatibility), and never change the record.

This module knows fields, not files: :mod:`quillcache.traces.loader` reads files, line numbers, ordering
and error modes, and builds :class:`quillcache.traces.loader.TraceRequest` from the values returned here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quillcache._checks import check_int
from quillcache.identity.scope import NAME_RE, TENANT_ID_RE
from quillcache.types import _KNOWN_DTYPES

__all__ = [
    "FIELDS",
    "MOONCAKE_BLOCK_TOKENS",
    "SCHEMAS",
    "FieldSpec",
    "SchemaError",
    "check_record",
]

MOONCAKE_BLOCK_TOKENS = 512
SCHEMAS = ("mooncake", "generated", "collision")
MAX_BLOCK_TOKENS = 65_536  # KvLayout's limit
_U64 = 1 << 64
_I63 = 1 << 63
_I31 = 1 << 31


class SchemaError(ValueError):
    """A trace record whose fields break a schema rule (the message names field, value and rule)."""


@dataclass(frozen=True, kw_only=True)
class FieldSpec:
    """One field of a trace line: its JSON type, range, the schema that introduced it, and meaning."""

    name: str
    kind: str  # "int", "ids" (list of ints) or "str" (identity string) or "dtype"
    lo: int = 0
    hi: int = _I63  # exclusive
    schema: str = "mooncake"
    required: bool = False
    meaning: str = ""


MAX_TIMESTAMP_MS = 10**12

FIELDS: tuple[FieldSpec, ...] = (
    # arrival times become float seconds; beyond 10**12 ms (~31.7 years) a float64 can no longer
    # resolve a microsecond, so TTFTs and queueing would be silently wrong
    FieldSpec(name="timestamp", kind="int", hi=MAX_TIMESTAMP_MS + 1, required=True,
              meaning="arrival, ms from trace start (<= 10**12)"),
    FieldSpec(name="input_length", kind="int", hi=_I31, required=True, meaning="prompt tokens"),
    FieldSpec(name="output_length", kind="int", hi=_I31, required=True, meaning="tokens to generate"),
    FieldSpec(name="hash_ids", kind="ids", hi=_U64, required=True,
              meaning="one prefix-chained id per block_tokens-token block"),
    FieldSpec(name="block_tokens", kind="int", lo=1, hi=MAX_BLOCK_TOKENS + 1, schema="generated",
              meaning="tokens per hash_ids block (absent: 512, the Mooncake release)"),
    FieldSpec(name="tenant", kind="tenant", schema="generated", meaning="tenant id (\"\" = no tenants)"),
    FieldSpec(name="model", kind="name", schema="generated", meaning="model name (\"\" = the replay's default)"),
    FieldSpec(name="tokenizer", kind="name", schema="generated", meaning="tokenizer name (\"\" = the model's own)"),
    FieldSpec(name="adapter", kind="name", schema="generated", meaning="LoRA adapter (\"\" = base model)"),
    FieldSpec(name="kv_dtype", kind="dtype", schema="generated", meaning="KV layout dtype (\"\" = the replay's default)"),
    FieldSpec(name="session_id", kind="int", lo=-1, schema="generated", meaning="multi-turn session (-1 = unknown)"),
    FieldSpec(name="turn", kind="int", hi=_I31, schema="generated", meaning="turn within the session, from 0"),
    FieldSpec(name="public_prefix_blocks", kind="int", hi=_I31, schema="collision",
              meaning="leading blocks that are a registered public system prompt"),
    FieldSpec(name="intent", kind="intent", schema="collision", meaning="how the request relates to its prefix's writer"),
)
_BY_NAME = {f.name: f for f in FIELDS}
_OPTIONAL = tuple(f for f in FIELDS if not f.required)
_INTENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz-")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _typename(value: object) -> str:
    return {bool: "boolean", float: "number", str: "string", list: "list", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _int(spec: FieldSpec, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(f"field {spec.name!r} must be an integer, got {_typename(v)} {_show(v)}")
    if v < spec.lo:
        what = "negative" if v < 0 and spec.lo == 0 else f"below {spec.lo}"
        raise SchemaError(f"field {spec.name!r} is {what} ({v}); expected an integer >= {spec.lo}")
    if v >= spec.hi:
        raise SchemaError(f"field {spec.name!r} = {_show(v)} is too large; expected < {spec.hi}")
    return v


def _ids(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise SchemaError(f"field 'hash_ids' must be a list of integers, got {_typename(v)} {_show(v)}")
    for k, i in enumerate(v):
        if isinstance(i, bool) or not isinstance(i, int):
            raise SchemaError(f"hash_ids[{k}] must be an integer, got {_typename(i)} {_show(i)}")
        if not 0 <= i < _U64:
            raise SchemaError(f"hash_ids[{k}] = {_show(i)} is outside [0, 2**64)")
    return tuple(v)


def _str(spec: FieldSpec, v: Any) -> str:
    if not isinstance(v, str):
        raise SchemaError(f"field {spec.name!r} must be a string, got {_typename(v)} {_show(v)}")
    if v == "":
        return v
    if spec.kind == "tenant":
        ok, rule = TENANT_ID_RE.fullmatch(v), "1-128 characters from [A-Za-z0-9._:@-]"
    elif spec.kind == "name":
        ok, rule = NAME_RE.fullmatch(v), "1-256 characters from [A-Za-z0-9._:@/+=-]"
    elif spec.kind == "dtype":
        ok, rule = v in _KNOWN_DTYPES, f"one of {sorted(_KNOWN_DTYPES)}"
    else:  # intent: a lower-case word such as "same-scope"
        ok, rule = len(v) <= 64 and set(v) <= _INTENT_CHARS, "1-64 characters from [a-z-]"
    if not ok:
        raise SchemaError(f"field {spec.name!r} = {_show(v)} is malformed; expected \"\" or {rule}")
    return v


def check_record(obj: object, *, block_tokens: int | None = None) -> tuple[dict[str, Any], str]:
    """Validate one decoded trace line; return (``TraceRequest`` keyword values, schema name).

    ``block_tokens``: the caller's block size for lines without a ``block_tokens`` field (``None`` =
    512, the Mooncake release); a line whose own field differs from an explicit value is refused. A
    ``block_tokens`` that is not an integer in [1, ``MAX_BLOCK_TOKENS``] is the caller's error: ``ValueError``.
    """
    if block_tokens is not None:
        check_int("block_tokens", block_tokens, 1, MAX_BLOCK_TOKENS, type_error=ValueError)
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object, got {_typename(obj)}")
    missing = [f.name for f in FIELDS if f.required and f.name not in obj]
    if missing:
        raise SchemaError(f"missing field(s) {', '.join(map(repr, missing))}")
    out: dict[str, Any] = {
        "timestamp_ms": _int(_BY_NAME["timestamp"], obj["timestamp"]),
        "input_tokens": _int(_BY_NAME["input_length"], obj["input_length"]),
        "output_tokens": _int(_BY_NAME["output_length"], obj["output_length"]),
        "hash_ids": _ids(obj["hash_ids"]),
    }
    schema = "mooncake"
    extra: dict[str, Any] = {}
    for spec in _OPTIONAL:
        if spec.name not in obj:
            continue
        v = obj[spec.name]
        extra[spec.name] = _int(spec, v) if spec.kind == "int" else _str(spec, v)
        if SCHEMAS.index(spec.schema) > SCHEMAS.index(schema):
            schema = spec.schema
    bt = extra.get("block_tokens")
    if bt is None:
        bt = MOONCAKE_BLOCK_TOKENS if block_tokens is None else block_tokens
    elif block_tokens is not None and bt != block_tokens:
        raise SchemaError(f"line says block_tokens {bt} but the caller asked for block_tokens={block_tokens}")
    isl, ids = out["input_tokens"], out["hash_ids"]
    want = -(-isl // bt)
    if len(ids) != want:
        raise SchemaError(f"{len(ids)} hash_ids for input_length {isl}; expected ceil({isl}/{bt}) = {want}")
    ppb = extra.get("public_prefix_blocks", 0)
    if ppb > isl // bt:
        raise SchemaError(f"public_prefix_blocks {ppb} > {isl // bt} full blocks of the prompt")
    out["block_tokens"] = bt
    for name in ("tenant", "model", "tokenizer", "adapter", "kv_dtype", "session_id"):
        if name in extra:
            out[name] = extra[name]
    return out, schema
