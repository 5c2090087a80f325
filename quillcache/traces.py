"""Mooncake-format request traces: one JSON object per line, sorted by arrival.

Fields: ``timestamp`` (ms from trace start), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one prefix-chained id per ``block_size_tokens``-token block, 512 in the Mooncake
release). A malformed line is refused with its line number and what was wrong; nothing is guessed.
The default path is ``../shared/traces/conversation_trace.jsonl`` relative to the project root;
every tool takes a path so users can point it at their own copy. Trace files are never vendored.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "conversation_trace.jsonl"
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file or line that does not follow the Mooncake format."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def default_trace_path() -> Path:
    """$QUILLCACHE_TRACE if set, else the shared Mooncake conversation trace."""
    return Path(os.environ.get("QUILLCACHE_TRACE", DEFAULT_TRACE))


def _field_int(obj: dict, name: str, where: str) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: field {name!r} must be a non-negative integer, got {v!r}")
    return v


def parse_line(line: str, where: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> TraceRequest:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = _field_int(obj, "timestamp", where)
    isl = _field_int(obj, "input_length", where)
    osl = _field_int(obj, "output_length", where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of non-negative integers")
    want = math.ceil(isl / block_tokens)
    if len(ids) != want:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for input_length {isl}; expected ceil({isl}/{block_tokens}) = {want}"
        )
    return TraceRequest(ts, isl, osl, tuple(ids))


def load_trace(path: str | os.PathLike | None = None, *, limit: int | None = None,
               block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRequest]:
    """Read and validate a Mooncake-format trace (arrival order must be non-decreasing)."""
    p = Path(path) if path is not None else default_trace_path()
    if not p.is_file():
        raise TraceError(f"trace file {p} does not exist (point the tool at your copy with a path argument)")
    out: list[TraceRequest] = []
    last_ts = -1
    with open(p, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            req = parse_line(line, f"{p}:{lineno}", block_tokens)
            if req.timestamp_ms < last_ts:
                raise TraceError(f"{p}:{lineno}: timestamp {req.timestamp_ms} < previous {last_ts}; traces must be sorted")
            last_ts = req.timestamp_ms
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TraceError(f"trace file {p} holds no requests")
    return out
