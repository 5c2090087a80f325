"""Fuzz targets: every parser of untrusted bytes only ever raises the project's typed errors.

Run with the normal budget by ``make test`` and with a large one by ``make fuzz``
(``HYPOTHESIS_PROFILE=fuzz``; ``QUILLCACHE_FUZZ_EXAMPLES`` sets the examples per target). Each
target mixes plain random bytes with structure-aware mutations of valid inputs (valid headers and
records with bytes flipped, truncated or appended), so the fuzzer reaches past the first check.

- the WAL scanner, in every recovery mode: ``WalCorruptionError`` or a report whose records all
  verify (their LSNs consecutive from the header's base, outside skipped ranges);
- the SSD log's payload decoder: ``ValueError`` naming the problem, or entries that re-encode to
  the same bytes;
- the trace loader, line by line and as a file: ``TraceError``/``SchemaError``, or requests that
  satisfy the schema's ranges.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.durability import wal as W
from quillcache.store import ssd_log
from quillcache.traces.loader import TraceError, load_trace_report, parse_line
from quillcache.traces.schemas import MAX_TIMESTAMP_MS, SchemaError

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _valid_log(seed: int, n: int) -> bytearray:
    rng = random.Random(seed)
    header = W.encode_header(rng.getrandbits(64), 1 + rng.randrange(1 << 20))
    hdr = W.decode_header(header, "fuzz")
    out = bytearray(header)
    lsn = hdr.base_lsn
    for _ in range(n):
        payload = rng.randbytes(rng.randrange(0, 200))
        out += W._REC.pack(len(payload), W._record_crc(hdr.epoch, lsn, lsn - 1, payload), lsn, lsn - 1) + payload
        lsn += 1
    return out


@st.composite
def log_images(draw) -> bytes:
    base = _valid_log(draw(st.integers(0, 2**32)), draw(st.integers(0, 12)))
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "append", "splice"]))
        if op == "flip" and base:
            i = draw(st.integers(0, len(base) - 1))
            base[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del base[draw(st.integers(0, len(base))):]
        elif op == "append":
            base += draw(st.binary(max_size=200))
        elif op == "splice" and len(base) > 2:
            i = draw(st.integers(0, len(base) - 1))
            base[i:i] = draw(st.binary(max_size=48))
    return bytes(base)


@settings(suppress_health_check=_SUPPRESS)
@given(image=st.one_of(log_images(), st.binary(max_size=400)), mode=st.sampled_from(sorted(W.RECOVERY_MODES)))
def test_fuzz_wal_scan(image, mode):
    try:
        report, records = W.scan_bytes(image, "fuzz.wal", mode=mode)
    except W.WalCorruptionError:
        return
    lsns = [lsn for lsn, _ in records]
    assert lsns == sorted(set(lsns)) and all(lsn >= report.header.base_lsn for lsn in lsns)
    assert report.valid_bytes <= report.file_bytes == len(image)
    if not report.damaged_lsns:
        assert lsns == list(range(report.header.base_lsn, report.header.base_lsn + len(lsns)))


@st.composite
def log_payloads(draw) -> bytes:
    kind = draw(st.sampled_from([ssd_log.KIND_BATCH, ssd_log.KIND_SNAPSHOT, ssd_log.KIND_END, b"X"]))
    entries = [ssd_log.ENTRY.pack(draw(st.sampled_from([ssd_log.PUT, ssd_log.DEL])), draw(st.binary(min_size=24,
                                                                                                 max_size=24)),
                                  draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**64 - 1)),
                                  draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)))
               for _ in range(draw(st.integers(0, 4)))]
    raw = bytearray(ssd_log.encode_record(kind, entries))
    if draw(st.booleans()) and raw:
        del raw[draw(st.integers(0, len(raw) - 1)):]
    return bytes(raw)


@settings(suppress_health_check=_SUPPRESS)
@given(payload=st.one_of(log_payloads(), st.binary(max_size=300)))
def test_fuzz_ssd_log_payload_decoder(payload):
    try:
        kind, entries = ssd_log.decode_record(payload)
    except ValueError as exc:
        assert str(exc)
        return
    assert ssd_log.encode_record(kind, [ssd_log.ENTRY.pack(*e) for e in entries]) == payload


_FIELD_VALUES = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=8), st.none(),
                          st.booleans(), st.lists(st.integers(-5, 2**65), max_size=6))


@st.composite
def trace_lines(draw) -> bytes:
    import json

    obj = {"timestamp": draw(st.integers(0, 10**6)), "input_length": draw(st.integers(0, 4096)),
           "output_length": draw(st.integers(0, 64)), "hash_ids": draw(st.lists(st.integers(0, 100), max_size=8))}
    for key in draw(st.lists(st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "tenant",
                                              "block_tokens", "model", "extra"]), max_size=3)):
        obj[key] = draw(_FIELD_VALUES)
    text = json.dumps(obj)
    if draw(st.booleans()):
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.text(max_size=4)) + text[i:]
    return text.encode("utf-8", "surrogatepass")


@settings(suppress_health_check=_SUPPRESS)
@given(line=st.one_of(trace_lines(), st.binary(max_size=200)))
def test_fuzz_trace_line(line):
    try:
        req = parse_line(line, "fuzz:1")
    except (TraceError, SchemaError) as exc:
        assert str(exc).startswith("fuzz:1: ")
        return
    assert 0 <= req.timestamp_ms <= MAX_TIMESTAMP_MS
    assert req.input_tokens >= 0 and req.output_tokens >= 0
    assert all(0 <= h < 2**64 for h in req.hash_ids)


@settings(suppress_health_check=_SUPPRESS, max_examples=max(10, settings().max_examples // 10))
@given(lines=st.lists(st.one_of(trace_lines(), st.binary(max_size=80)), min_size=1, max_size=8),
       on_error=st.sampled_from(["stop", "skip"]))
def test_fuzz_trace_file(tmp_path_factory, lines, on_error):
    path = tmp_path_factory.mktemp("fuzz") / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    try:
        reqs, report = load_trace_report(path, on_error=on_error)
    except TraceError as exc:
        assert str(path) in str(exc) or "trace" in str(exc)
        return
    stamps = [r.timestamp_ms for r in reqs]
    assert stamps == sorted(stamps) and len(reqs) == report.num_requests
