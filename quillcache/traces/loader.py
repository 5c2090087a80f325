"""Request traces: read a JSON-Lines trace into :class:`TraceRequest` records, line by line.

A trace is one JSON object per line, sorted by arrival. The Mooncake schema (``timestamp`` ms from
trace start, ``input_length``/``output_length`` tokens, ``hash_ids``: one prefix-chained id per
``block_tokens``-token block, 512 in the Mooncake release) is required on every line; the project's
generated traces (sessions, collision) add identity and session fields
(:mod:`quillcache.traces.schemas` holds the field rules; ``traces/README.md`` documents them).

Invariants:

- every returned request passed :func:`quillcache.traces.schemas.check_record`; timestamps of the
  returned requests never decrease (a line earlier than the last good line is malformed, and the
  message names both line numbers);
- ``on_error="stop"`` (default) raises :class:`TraceError` ``"FILE:LINE: what was wrong"`` at the
  first malformed line; ``on_error="skip"`` drops malformed lines and returns exactly the good ones,
  listing every dropped line with its number and reason in :class:`TraceLoadReport`;
- file-level problems (missing, a directory, empty or blank-only, binary/compressed, unreadable, a
  path the system cannot look up such as a name over 255 bytes, no valid line) always raise
  :class:`TraceError` naming the path, whatever ``on_error`` says - never a bare ``OSError``;
- a JSON object that names a field twice is malformed (``field 'x' appears twice``): no value is
  picked for the user;
- :func:`synthesize_tokens` is a pure function of (hash id, position in block): equal hash-id
  prefixes give equal token prefixes, block by block, and for ``block_tokens >= D`` distinct ids
  always give distinct blocks, where ``D`` is the number of base-``vocab_size`` digits of a 64-bit
  value (4 for the default Llama-3 vocabulary; more for a smaller one): the first ``D`` tokens are
  those digits of a bijective 64-bit mix of the id.

:func:`default_trace_path` is the one place that finds the shared trace: ``$QUILLCACHE_TRACE`` if
set, else ``../shared/traces/conversation_trace.jsonl`` relative to the project root
(``DEFAULT_TRACE``). ``load_trace()`` without a path, the studies and the tests' ``trace_path``
fixture all go through it; every tool also takes a path so users can point it at their own copy.
Trace files are never vendored.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quillcache._checks import check_choice, check_int
from quillcache._mix import GOLDEN, mix13, mix13_array, splitmix64, splitmix64_array
from quillcache.traces.schemas import (
    MAX_BLOCK_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    SCHEMAS,
    SchemaError,
    check_record,
)

__all__ = [
    "DEFAULT_TRACE",
    "DEFAULT_VOCAB_SIZE",
    "MOONCAKE_BLOCK_TOKENS",
    "ON_ERROR",
    "SkippedLine",
    "TraceError",
    "TraceLoadReport",
    "TraceRequest",
    "default_trace_path",
    "load_trace",
    "load_trace_report",
    "parse_line",
    "synthesize_tokens",
    "synthesize_tokens_reference",
]

DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
ON_ERROR = ("stop", "skip")
DEFAULT_VOCAB_SIZE = 128_256  # Llama-3 vocabulary: synthesised token ids are below it
_BINARY_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
                 b"PK\x03\x04": "zip", b"PAR1": "parquet"}
_SNIFF_BYTES = 8192


class TraceError(ValueError):
    """A trace file or line that does not follow the trace schemas (message: ``FILE[:LINE]: what``)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. The first four fields are the Mooncake schema; the rest default to
    "not given" so Mooncake traces and hand-built records keep working."""

    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one prefix-chained id per block_tokens-token block
    tenant: str = ""  # "" = the trace has no tenants: the replay uses one default tenant
    model: str = ""  # "" = the replay's default model
    tokenizer: str = ""
    adapter: str = ""  # LoRA adapter, "" = base model
    kv_dtype: str = ""  # "" = the replay's default layout
    session_id: int = -1  # multi-turn session of a generated trace, -1 = unknown
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash_id block (Mooncake: 512)

    @property
    def num_full_blocks(self) -> int:
        return self.input_tokens // self.block_tokens

    def tokens(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> np.ndarray:
        """Synthesised prompt token ids (:func:`synthesize_tokens`)."""
        return synthesize_tokens(self.hash_ids, self.block_tokens, self.input_tokens, vocab_size=vocab_size)


@dataclass(frozen=True, slots=True)
class SkippedLine:
    line: int  # 1-based line number in the file
    reason: str


@dataclass(frozen=True, slots=True)
class TraceLoadReport:
    """What a load read: lines, requests kept, lines skipped (with numbers and reasons), schemas."""

    path: str
    num_lines: int  # non-blank lines read (up to the limit)
    num_blank_lines: int
    num_requests: int
    skipped: tuple[SkippedLine, ...]
    schemas: tuple[str, ...]  # schemas seen, in trace_schemas.SCHEMAS order
    stopped_at_limit: bool

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def summary(self, max_listed: int = 5) -> str:
        """A few human-readable lines: counts, then the first ``max_listed`` skipped lines."""
        head = (f"{self.path}: {self.num_requests} requests from {self.num_lines} lines "
                f"({', '.join(self.schemas) or 'no'} schema)")
        if not self.skipped:
            return head
        rows = [head + f"; skipped {self.num_skipped} malformed line(s):"]
        rows += [f"  line {s.line}: {s.reason}" for s in self.skipped[:max_listed]]
        if self.num_skipped > max_listed:
            rows.append(f"  ... and {self.num_skipped - max_listed} more")
        return "\n".join(rows)


def default_trace_path() -> Path:
    """$QUILLCACHE_TRACE if set, else the shared Mooncake conversation trace."""
    return Path(os.environ.get("QUILLCACHE_TRACE", DEFAULT_TRACE))


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` object hook: a key given twice is an error, not "the last one wins"."""
    obj = dict(pairs)
    if len(obj) != len(pairs):  # rare: only then look for the name
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise SchemaError(f"field {key!r} appears twice in one object; which value is meant is ambiguous")
            seen.add(key)
    return obj


def _decode(line: str | bytes) -> object:
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SchemaError(f"not UTF-8 text (byte {exc.start})") from None
    try:
        # rstrip: an error's column is within the line as the user sees it
        return json.loads(line.rstrip("\r\n"), object_pairs_hook=_no_duplicate_keys)
    except SchemaError:  # _no_duplicate_keys: its own message
        raise
    except RecursionError:
        raise SchemaError("not valid JSON (nested too deeply)") from None
    except json.JSONDecodeError as exc:
        # the line is one JSON document: name the column within it, not json's own line/column
        raise SchemaError(f"not valid JSON at column {exc.pos + 1} ({exc.msg})") from None
    except ValueError as exc:
        raise SchemaError(f"not valid JSON ({str(exc)[:80]})") from None


def _record(line: str | bytes, block_tokens: int | None) -> tuple[TraceRequest, str]:
    fields, schema = check_record(_decode(line), block_tokens=block_tokens)
    return TraceRequest(**fields), schema


def parse_line(line: str | bytes, where: str, block_tokens: int | None = None) -> TraceRequest:
    """One trace line as a request, or :class:`TraceError` ``"{where}: what was wrong"``."""
    try:
        return _record(line, block_tokens)[0]
    except SchemaError as exc:
        raise TraceError(f"{where}: {exc}") from None


def _check_args(limit: object, block_tokens: object, on_error: object) -> None:
    if limit is not None:
        check_int("limit", limit, 1, type_error=ValueError)
    if block_tokens is not None:
        check_int("block_tokens", block_tokens, 1, MAX_BLOCK_TOKENS, type_error=ValueError)
    check_choice("on_error", on_error, ON_ERROR)


def _open_trace(p: Path):
    """Open ``p`` for binary line reading after file-level checks (exists, a regular file, not binary);
    every ``OSError`` on the way (a name too long, a folder that may not be searched, a read error)
    becomes a :class:`TraceError` naming ``p``. An empty file passes: the caller finds no request."""
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise TraceError(f"trace file {p} does not exist (point the tool at your copy with a path argument)") from None
    except OSError as exc:
        raise TraceError(f"cannot access trace file {p}: {exc.strerror or exc}") from None
    except ValueError as exc:  # an embedded NUL byte
        raise TraceError(f"cannot access trace file {str(p)!r}: {exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceError(f"{p} is a directory, not a trace file (give the path of a .jsonl file)")
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(f"{p} is not a regular file")
    try:
        fh = open(p, "rb")  # noqa: SIM115 - returned open; the caller closes it with `with`
    except OSError as exc:
        raise TraceError(f"cannot open trace file {p}: {exc.strerror or exc}") from None
    try:
        try:
            head = fh.read(_SNIFF_BYTES)
        except OSError as exc:
            raise TraceError(f"error reading trace file {p}: {exc.strerror or exc}") from None
        for magic, kind in _BINARY_MAGIC.items():
            if head.startswith(magic):
                raise TraceError(f"{p} is a {kind} file, not JSON Lines text (decompress/convert it first)")
        if b"\x00" in head:
            raise TraceError(f"{p} is a binary file (NUL bytes), not JSON Lines text")
        fh.seek(0)
    except BaseException:
        fh.close()
        raise
    return fh


def trace_lines(p: Path) -> Iterator[tuple[int, bytes]]:
    """``p``'s lines, numbered from 1, after the file-level checks (:func:`_open_trace`): a UTF-8
    byte-order mark on line 1 removed, blank lines included (the caller decides); an ``OSError``
    while reading is a :class:`TraceError` naming ``p``. Close it (``contextlib.closing``) to close
    the file when stopping early."""
    with _open_trace(p) as fh:
        try:
            for lineno, raw in enumerate(fh, 1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]  # a UTF-8 byte-order mark
                yield lineno, raw
        except OSError as exc:
            raise TraceError(f"error reading trace file {p}: {exc.strerror or exc}") from None


def load_trace_report(path: str | os.PathLike | None = None, *, limit: int | None = None,
                      block_tokens: int | None = None,
                      on_error: str = "stop") -> tuple[list[TraceRequest], TraceLoadReport]:
    """Read and validate a trace; return its requests and a :class:`TraceLoadReport`.

    ``limit``: stop after this many good requests. ``block_tokens``: block size for lines without a
    ``block_tokens`` field (``None`` = 512; an explicit value a line contradicts is an error).
    ``on_error``: ``"stop"`` raises at the first malformed line, ``"skip"`` drops it and goes on.
    """
    _check_args(limit, block_tokens, on_error)
    p = Path(path) if path is not None else default_trace_path()
    skip = on_error == "skip"
    out: list[TraceRequest] = []
    skipped: list[SkippedLine] = []
    seen: set[str] = set()
    last_ts, last_line = -1, 0
    num_lines = num_blank = 0
    at_limit = False
    with contextlib.closing(trace_lines(p)) as lines:
        for lineno, raw in lines:
            if not raw.strip():
                num_blank += 1
                continue
            num_lines += 1
            try:
                req, schema = _record(raw, block_tokens)
                if req.timestamp_ms < last_ts:
                    raise SchemaError(f"timestamp {req.timestamp_ms} is earlier than timestamp {last_ts} at "
                                      f"line {last_line}; a trace must be sorted by timestamp")
            except SchemaError as exc:
                if not skip:
                    raise TraceError(f"{p}:{lineno}: {exc}") from None
                skipped.append(SkippedLine(lineno, str(exc)))
                continue
            last_ts, last_line = req.timestamp_ms, lineno
            seen.add(schema)
            out.append(req)
            if limit is not None and len(out) >= limit:
                at_limit = True
                break
    if not out:
        if skipped:
            first = skipped[0]
            raise TraceError(f"trace file {p} holds no valid request: all {len(skipped)} line(s) are malformed "
                             f"(first, line {first.line}: {first.reason})")
        # no line was read at all: nothing but blank lines (or a byte-order mark), however many
        raise TraceError(f"trace file {p} is empty (expected one JSON object per line)")
    report = TraceLoadReport(path=str(p), num_lines=num_lines, num_blank_lines=num_blank, num_requests=len(out),
                             skipped=tuple(skipped), schemas=tuple(s for s in SCHEMAS if s in seen),
                             stopped_at_limit=at_limit)
    return out, report


def load_trace(path: str | os.PathLike | None = None, *, limit: int | None = None,
               block_tokens: int | None = None, on_error: str = "stop") -> list[TraceRequest]:
    """Read and validate a trace (see :func:`load_trace_report`); return its requests only."""
    return load_trace_report(path, limit=limit, block_tokens=block_tokens, on_error=on_error)[0]


# --------------------------------------------------------------------------- token synthesis
_U64_MASK = (1 << 64) - 1


def _check_synth(hash_ids: object, block_tokens: object, input_tokens: object, vocab_size: object) -> np.ndarray:
    for name, v, lo, hi in (("block_tokens", block_tokens, 1, MAX_BLOCK_TOKENS),
                            ("input_tokens", input_tokens, 0, 1 << 31), ("vocab_size", vocab_size, 2, 1 << 32)):
        check_int(name, v, lo, hi)
    if isinstance(hash_ids, np.ndarray):
        if hash_ids.ndim != 1 or not (np.issubdtype(hash_ids.dtype, np.integer)):
            raise TypeError(f"hash_ids must be a 1-d integer array, got {hash_ids.ndim}-d {hash_ids.dtype}")
        if hash_ids.size and np.issubdtype(hash_ids.dtype, np.signedinteger) and int(hash_ids.min()) < 0:
            raise ValueError(f"hash_ids hold a negative id ({int(hash_ids.min())})")
        ids = hash_ids.astype(np.uint64)
    else:
        if not isinstance(hash_ids, Iterable) or isinstance(hash_ids, (str, bytes)):
            raise TypeError(f"hash_ids must be a sequence of ints, got {type(hash_ids).__name__}")
        vals = list(hash_ids)
        for k, i in enumerate(vals):
            check_int(f"hash_ids[{k}]", i, 0, _U64_MASK)
        ids = np.array([int(i) for i in vals], dtype=np.uint64)
    n, bt, isl = len(ids), int(block_tokens), int(input_tokens)
    if -(-isl // bt) != n:
        raise ValueError(f"{n} hash_ids cannot cover input_tokens={isl} at block_tokens={bt} "
                         f"(expected ceil({isl}/{bt}) = {-(-isl // bt)} ids)")
    return ids


def _digits(vocab_size: int) -> int:
    """Tokens needed to write any 64-bit value in base ``vocab_size``."""
    k, span = 0, 1
    while span < (1 << 64):
        span *= vocab_size
        k += 1
    return k


def synthesize_tokens(hash_ids: Iterable[int] | np.ndarray, block_tokens: int, input_tokens: int, *,
                      vocab_size: int = DEFAULT_VOCAB_SIZE) -> np.ndarray:
    """Deterministic token ids (uint32, below ``vocab_size``) for a trace request without tokens.

    Block ``j`` is a pure function of ``hash_ids[j]`` (hash ids are prefix-chained, so equal hash-id
    prefixes give equal token prefixes). With ``x = splitmix64(id)`` (``quillcache._mix``, a bijection):
    token ``p < D`` of the block is base-``vocab_size`` digit ``p`` of ``x`` (``D`` digits cover 64 bits:
    4 for the Llama-3 vocabulary), token ``p >= D`` is ``mix13(x + p * GOLDEN) % vocab_size`` (splitmix64's finaliser). So for
    ``block_tokens >= D`` distinct ids always give distinct blocks. The last block may be partial.
    """
    ids = _check_synth(hash_ids, block_tokens, input_tokens, vocab_size)
    bt, vs = int(block_tokens), int(vocab_size)
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint32)
    d = _digits(vs)
    with np.errstate(over="ignore"):
        x = splitmix64_array(ids)  # (n,)
    toks = np.empty((ids.size, bt), dtype=np.uint64)
    v64 = np.uint64(vs)
    rest = x.copy()
    for p in range(min(d, bt)):
        toks[:, p] = rest % v64
        rest //= v64
    if bt > d:
        with np.errstate(over="ignore"):
            pos = np.arange(d, bt, dtype=np.uint64) * np.uint64(GOLDEN)
            toks[:, d:] = mix13_array(x[:, None] + pos[None, :]) % v64
    return toks.reshape(-1)[: int(input_tokens)].astype(np.uint32)


def synthesize_tokens_reference(hash_ids: Iterable[int], block_tokens: int, input_tokens: int, *,
                                vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """Plain-Python specification of :func:`synthesize_tokens` (same rule, Python ints, one token at a time)."""
    ids = [int(i) for i in _check_synth(hash_ids, block_tokens, input_tokens, vocab_size)]
    d = _digits(vocab_size)
    out: list[int] = []
    for h in ids:
        x = splitmix64(h)
        for p in range(block_tokens):
            if p < d:
                out.append((x // vocab_size ** p) % vocab_size)
            else:
                out.append(mix13(x + p * GOLDEN) % vocab_size)
    return out[:input_tokens]
