import gzip
import json
import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.traces.schemas import FIELDS, SCHEMAS
from quillcache.traces.loader import (
    TraceError,
    TraceRequest,
    default_trace_path,
    load_trace,
    load_trace_report,
    parse_line,
    synthesize_tokens,
    synthesize_tokens_reference,
)
from quillcache.traces.collision import CollisionConfig, generate, write_jsonl

README = Path(__file__).resolve().parent.parent / "traces" / "README.md"


def _write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def _rec(ts=0, isl=1, osl=1, ids=(0,), **extra):
    return json.dumps({"timestamp": ts, "input_length": isl, "output_length": osl, "hash_ids": list(ids), **extra})


def test_loads_valid_trace(tmp_path):
    p = _write(tmp_path, [
        json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}),
        json.dumps({"timestamp": 3, "input_length": 512, "output_length": 1, "hash_ids": [0]}),
    ])
    tr = load_trace(p)
    assert [r.hash_ids for r in tr] == [(0, 1), (0,)]
    assert tr[1].timestamp_ms == 3
    assert tr[0] == TraceRequest(0, 1000, 5, (0, 1))  # Mooncake lines: every optional field at its default
    assert (tr[0].tenant, tr[0].session_id, tr[0].block_tokens) == ("", -1, 512)


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}), "timestamp"),
        (json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-3]}), "hash_ids"),
        (json.dumps({"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}), "expected ceil"),
        (json.dumps({"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [0]}), "input_length"),
        ("[" * 100000, "not valid JSON"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, match):
    good = json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]})
    p = _write(tmp_path, [good, line])
    with pytest.raises(TraceError, match=match) as ei:
        load_trace(p)
    assert ":2:" in str(ei.value)


# Every kind of malformed line: (line, words the reason must contain). Line 1 is good (timestamp 5).
BAD_LINES = {
    "json": ("{not json", "not valid JSON"),
    "deep-json": ("[" * 50_000, "not valid JSON"),
    "not-utf8": (b'{"timestamp": 9, "input_length": "\xff\xfe"}', "not UTF-8"),
    "not-object": ("[1, 2]", "expected a JSON object, got list"),
    "string-line": ('"hello"', "expected a JSON object, got string"),
    "missing": (json.dumps({"timestamp": 6, "input_length": 1, "output_length": 1}), "missing field(s) 'hash_ids'"),
    "str-int": (_rec(ts=6, isl="9"), "'input_length' must be an integer, got string"),
    "float-int": (_rec(ts=6.5), "'timestamp' must be an integer, got number"),
    "bool-int": (_rec(ts=6, osl=True), "'output_length' must be an integer, got boolean"),
    "null-int": (_rec(ts=None), "'timestamp' must be an integer, got null"),
    "negative": (_rec(ts=6, osl=-2), "'output_length' is negative"),
    "ids-not-list": (json.dumps({"timestamp": 6, "input_length": 1, "output_length": 1, "hash_ids": 7}),
                     "'hash_ids' must be a list"),
    "id-negative": (_rec(ts=6, ids=(0, -1), isl=513), "hash_ids[1] = -1 is outside"),
    "id-huge": (_rec(ts=6, ids=(2 ** 64,)), "outside [0, 2**64)"),
    "id-str": (_rec(ts=6, ids=("a",)), "hash_ids[0] must be an integer"),
    "count": (_rec(ts=6, isl=1025, ids=(0, 1)), "2 hash_ids for input_length 1025; expected ceil(1025/512) = 3"),
    "earlier": (_rec(ts=4), "timestamp 4 is earlier than timestamp 5 at line 1"),
    "tenant": (_rec(ts=6, tenant="evil tenant/.."), "'tenant'"),
    "tenant-type": (_rec(ts=6, tenant=3), "'tenant' must be a string, got int"),
    "model": (_rec(ts=6, model="bad model\n"), "'model'"),
    "kv-dtype": (_rec(ts=6, kv_dtype="fp99"), "'kv_dtype'"),
    "block-tokens-zero": (_rec(ts=6, block_tokens=0), "'block_tokens' is below 1"),
    "session": (_rec(ts=6, session_id=-2), "'session_id' is below -1"),
    "public-prefix": (_rec(ts=6, isl=16, ids=(0,), block_tokens=16, public_prefix_blocks=2),
                      "public_prefix_blocks 2 > 1 full blocks"),
    "intent": (_rec(ts=6, intent="DROP TABLE"), "'intent'"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_every_malformed_kind_is_reported_with_its_line_in_both_modes(tmp_path, kind):
    bad, words = BAD_LINES[kind]
    p = tmp_path / "t.jsonl"
    good1, good3 = _rec(ts=5).encode(), _rec(ts=7, ids=(3,)).encode()
    p.write_bytes(b"\n".join([good1, bad if isinstance(bad, bytes) else bad.encode(), good3]) + b"\n")
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    assert str(ei.value).startswith(f"{p}:2: ")
    assert words in str(ei.value)
    reqs, report = load_trace_report(p, on_error="skip")
    assert [r.timestamp_ms for r in reqs] == [5, 7]  # exactly the good lines
    assert [s.line for s in report.skipped] == [2] and words in report.skipped[0].reason
    assert (report.num_lines, report.num_requests, report.num_skipped) == (3, 2, 1)
    assert "line 2: " in report.summary()


def test_non_monotonic_names_both_lines_and_skip_compares_with_last_good_line(tmp_path):
    p = _write(tmp_path, [_rec(ts=10), "", _rec(ts=20), _rec(ts=15), _rec(ts=17), _rec(ts=25)])
    with pytest.raises(TraceError, match=r":4: timestamp 15 is earlier than timestamp 20 at line 3; .*sorted"):
        load_trace(p)
    reqs, rep = load_trace_report(p, on_error="skip")
    assert [r.timestamp_ms for r in reqs] == [10, 20, 25]
    assert [(s.line, s.reason.split(";")[0]) for s in rep.skipped] == [
        (4, "timestamp 15 is earlier than timestamp 20 at line 3"),
        (5, "timestamp 17 is earlier than timestamp 20 at line 3")]
    assert rep.num_blank_lines == 1


def test_file_level_errors(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl", on_error="skip")
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(TraceError, match="is empty"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    with pytest.raises(TraceError, match="is empty"):
        load_trace(tmp_path / "blank.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TraceError, match="binary file"):
        load_trace(tmp_path / "bin.jsonl", on_error="skip")
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress((_rec() + "\n").encode()))
    with pytest.raises(TraceError, match="gzip file"):
        load_trace(tmp_path / "t.jsonl.gz")
    p = _write(tmp_path, ["{bad", "[1]"], "allbad.jsonl")
    with pytest.raises(TraceError, match=r"no valid request: all 2 line\(s\) are malformed \(first, line 1: "):
        load_trace(p, on_error="skip")


def test_a_path_the_system_cannot_look_up_is_a_trace_error_naming_it(tmp_path):
    long_name = tmp_path / ("x" * 300 + ".jsonl")  # one name over 255 bytes: ENAMETOOLONG, not ENOENT
    for on_error in ("stop", "skip"):
        with pytest.raises(TraceError, match=f"cannot access trace file {re.escape(str(long_name))}: File name too long"):
            load_trace(long_name, on_error=on_error)
    file_as_folder = _write(tmp_path, [_rec()]) / "t.jsonl"  # a path through a regular file: ENOTDIR
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(file_as_folder)
    with pytest.raises(TraceError, match=re.escape(f"cannot access trace file {'a' + chr(0) + 'b'!r}: embedded null")):
        load_trace("a\x00b")


def test_blank_lines_past_the_sniffed_head_do_not_make_a_file_empty(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n" * 9000 + _rec(ts=4) + "\n")  # 9000 bytes of blank lines, then a request
    reqs, rep = load_trace_report(p)
    assert [r.timestamp_ms for r in reqs] == [4] and rep.num_blank_lines == 9000 and rep.num_lines == 1
    p.write_text("\n" * 9000 + "  \r\n")
    with pytest.raises(TraceError, match="is empty"):
        load_trace(p)


def test_a_field_given_twice_is_malformed_not_last_one_wins(tmp_path):
    dup = '{"timestamp": 7, "input_length": 600, "output_length": 5, "hash_ids": [0, 1], "timestamp": 0}'
    p = _write(tmp_path, [_rec(ts=0), dup, _rec(ts=8)])
    with pytest.raises(TraceError, match=r":2: field 'timestamp' appears twice in one object"):
        load_trace(p)
    reqs, rep = load_trace_report(p, on_error="skip")
    assert [r.timestamp_ms for r in reqs] == [0, 8] and [s.line for s in rep.skipped] == [2]
    with pytest.raises(TraceError, match=r"^x:1: field 'hash_ids' appears twice"):
        parse_line(_rec()[:-1] + ', "hash_ids": [0]}', "x:1")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads anything")
def test_unreadable_file(tmp_path):
    p = _write(tmp_path, [_rec()])
    p.chmod(0)
    try:
        with pytest.raises(TraceError, match="cannot open"):
            load_trace(p)
    finally:
        p.chmod(0o644)


def test_argument_validation(tmp_path):
    p = _write(tmp_path, [_rec()])
    for kwargs, match in (({"on_error": "ignore"}, "on_error='ignore'"), ({"limit": 0}, "limit=0"),
                          ({"limit": True}, "limit must be an integer, got bool True"), ({"block_tokens": 0}, "block_tokens=0")):
        with pytest.raises(ValueError, match=re.escape(match)):
            load_trace(p, **kwargs)


def test_block_tokens_argument_and_line_field(tmp_path):
    p = _write(tmp_path, [_rec(isl=20, ids=(0, 1)), _rec(ts=1, isl=20, ids=(0, 1, 2), block_tokens=8)])
    with pytest.raises(TraceError, match=":1: 2 hash_ids for input_length 20; expected ceil"):
        load_trace(p)  # line 1 has no block_tokens: 512
    reqs = load_trace(p, block_tokens=16, on_error="skip")  # line 2 contradicts the explicit 16
    assert [r.block_tokens for r in reqs] == [16]
    q = _write(tmp_path, [_rec(isl=20, ids=(0, 1, 2), block_tokens=8)], "q.jsonl")
    assert load_trace(q)[0].block_tokens == 8
    with pytest.raises(TraceError, match="line says block_tokens 8 but the caller asked for block_tokens=16"):
        load_trace(q, block_tokens=16)


def test_limit_counts_good_requests(tmp_path):
    p = _write(tmp_path, [_rec(ts=0), "oops", _rec(ts=1), _rec(ts=2), "oops"])
    reqs, rep = load_trace_report(p, limit=2, on_error="skip")
    assert [r.timestamp_ms for r in reqs] == [0, 1] and rep.stopped_at_limit and rep.num_skipped == 1
    assert load_trace(p, limit=1) == [TraceRequest(0, 1, 1, (0,))]


def test_generated_fields_and_unknown_fields(tmp_path):
    line = _rec(ts=3, isl=40, ids=(7, 8, 9), block_tokens=16, tenant="acme", model="meta/llama-3-8b",
                tokenizer="llama3", adapter="sql-lora", kv_dtype="float8_e4m3", session_id=12, turn=2,
                future_field={"x": 1})
    r = parse_line(line, "x:1")
    assert r == TraceRequest(3, 40, 1, (7, 8, 9), tenant="acme", model="meta/llama-3-8b", tokenizer="llama3",
                             adapter="sql-lora", kv_dtype="float8_e4m3", session_id=12, block_tokens=16)
    with pytest.raises(TraceError, match=r"^x:1: field 'turn' is negative"):
        parse_line(_rec(turn=-1), "x:1")


def test_reads_collision_jsonl_with_identity_fields(tmp_path):
    reqs = generate(CollisionConfig(mix="adversarial", num_requests=60, seed=3))
    path = tmp_path / "c.jsonl"
    write_jsonl(reqs, path)
    loaded, rep = load_trace_report(path)
    assert rep.schemas == ("collision",) and rep.num_skipped == 0
    assert [(x.timestamp_ms, x.input_tokens, x.output_tokens, x.hash_ids, x.tenant, x.model, x.tokenizer, x.adapter,
             x.kv_dtype, x.block_tokens) for x in loaded] == [
        (r.timestamp, r.input_length, r.output_length, r.hash_ids, r.tenant, r.model, r.tokenizer, r.adapter,
         r.kv_dtype, r.block_tokens) for r in reqs]


def test_readme_documents_every_field_and_schema():
    text = README.read_text()
    for f in FIELDS:
        assert f"`{f.name}`" in text, f.name
    for s in SCHEMAS:
        assert s in text.lower()
    assert "synthesize_tokens" in text


# --------------------------------------------------------------------------- Hypothesis: skip/stop
_BAD_KINDS = sorted(k for k in BAD_LINES if k != "earlier")


@given(st.lists(st.one_of(st.tuples(st.just("good"), st.integers(0, 3), st.integers(0, 1500)),
                          st.tuples(st.sampled_from(_BAD_KINDS + ["earlier"]), st.just(0), st.just(0))),
                min_size=1, max_size=25),
       st.booleans())
def test_skip_returns_exactly_the_good_lines_and_stop_the_first_bad_one(rows, blank_lines):
    lines: list[bytes] = []
    want, bad_lines = [], []
    ts = 100
    for kind, dt, isl in rows:
        if blank_lines and len(lines) % 3 == 2:
            lines.append(b"   ")
        if kind == "good":
            ts += dt
            ids = list(range(len(lines), len(lines) + -(-isl // 512)))
            lines.append(_rec(ts=ts, isl=isl, ids=ids).encode())
            want.append((ts, isl, tuple(ids), len(lines)))
        else:
            bad = _rec(ts=ts - 1) if kind == "earlier" and want else BAD_LINES["json" if kind == "earlier" else kind][0]
            lines.append(bad if isinstance(bad, bytes) else bad.encode())
            bad_lines.append(len(lines))
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl"
        p.write_bytes(b"\n".join(lines) + b"\n")
        if not want:
            with pytest.raises(TraceError, match="no valid request"):
                load_trace(p, on_error="skip")
        else:
            reqs, rep = load_trace_report(p, on_error="skip")
            assert [(r.timestamp_ms, r.input_tokens, r.hash_ids) for r in reqs] == [w[:3] for w in want]
            assert [s.line for s in rep.skipped] == bad_lines
        if bad_lines:
            with pytest.raises(TraceError) as ei:
                load_trace(p)
            assert str(ei.value).startswith(f"{p}:{bad_lines[0]}: ")
        else:
            assert len(load_trace(p)) == len(want)


# --------------------------------------------------------------------------- token synthesis
def test_synthesize_tokens_shape_and_validation():
    t = synthesize_tokens([5, 6], 16, 20)
    assert t.dtype == np.uint32 and t.shape == (20,) and int(t.max()) < 128_256
    assert np.array_equal(t, synthesize_tokens(np.array([5, 6], dtype=np.int64), 16, 20))
    assert synthesize_tokens([], 16, 0).shape == (0,)
    assert np.array_equal(TraceRequest(0, 20, 1, (5, 6), block_tokens=16).tokens(), t)
    for args, exc, match in (
        (([5, 6], 16, 33), ValueError, "2 hash_ids cannot cover input_tokens=33"),
        (([5, 6], 16, 16), ValueError, "expected ceil"),
        (([5], 0, 1), ValueError, "block_tokens=0"),
        (([-1], 16, 1), ValueError, r"hash_ids\[0\]=-1"),
        (([2 ** 64], 16, 1), ValueError, r"hash_ids\[0\]=18446744073709551616"),
        (([1.5], 16, 1), TypeError, r"hash_ids\[0\] must be an int"),
        (("ab", 16, 1), TypeError, "sequence of ints"),
        ((np.array([[1]]), 16, 1), TypeError, "1-d integer array"),
        ((np.array([-1]), 16, 1), ValueError, "negative"),
        (([1], 16.0, 1), TypeError, "block_tokens must be an int"),
    ):
        with pytest.raises(exc, match=match):
            synthesize_tokens(*args)
    with pytest.raises(ValueError, match="vocab_size=1"):
        synthesize_tokens([1], 16, 16, vocab_size=1)


_ids = st.integers(0, 2 ** 64 - 1)


@given(st.lists(_ids, max_size=6), st.integers(1, 40), st.data(),
       st.one_of(st.just(128_256), st.integers(2, 2 ** 32)))
def test_synthesize_tokens_matches_the_reference(ids, bt, data, vocab):
    isl = 0 if not ids else data.draw(st.integers((len(ids) - 1) * bt + 1, len(ids) * bt))
    fast = synthesize_tokens(ids, bt, isl, vocab_size=vocab)
    assert fast.tolist() == synthesize_tokens_reference(ids, bt, isl, vocab_size=vocab)
    assert all(0 <= t < vocab for t in fast.tolist())


@given(st.lists(_ids, min_size=1, max_size=5), st.lists(_ids, min_size=1, max_size=5),
       st.integers(0, 5), st.integers(1, 48), st.data())
def test_equal_hash_prefixes_iff_equal_token_prefixes_per_block(a, b, shared, bt, data):
    common = a[:shared]
    x, y = common + a[shared:], common + b
    tx = synthesize_tokens(x, bt, len(x) * bt - data.draw(st.integers(0, bt - 1)))
    ty = synthesize_tokens(y, bt, len(y) * bt)
    for j in range(min(len(x), len(y))):
        bx, by = tx[j * bt:(j + 1) * bt], ty[j * bt:(j + 1) * bt]
        n = min(len(bx), len(by))
        if x[j] == y[j]:
            assert np.array_equal(bx[:n], by[:n])  # equal ids -> equal tokens (a partial block is a prefix)
        elif bt >= 4 and n == bt:
            assert not np.array_equal(bx, by)  # distinct ids -> distinct full blocks, guaranteed from 4 tokens


def test_default_trace_path_honours_the_environment(tmp_path, monkeypatch):
    mine = _write(tmp_path, [_rec(0, 600, 3, (4, 5))], "mine.jsonl")
    monkeypatch.setenv("QUILLCACHE_TRACE", str(mine))
    assert default_trace_path() == mine
    assert load_trace() == [TraceRequest(0, 600, 3, (4, 5))]  # no path: the one default_trace_path() names
    monkeypatch.delenv("QUILLCACHE_TRACE")
    assert default_trace_path().name == "conversation_trace.jsonl"
    assert default_trace_path().parent.parts[-2:] == ("shared", "traces")


def test_shared_mooncake_trace_facts(trace_path):
    tr, rep = load_trace_report(trace_path)
    assert len(tr) == 12031 and rep.num_skipped == 0 and rep.schemas == ("mooncake",)
    assert sum(len(r.hash_ids) for r in tr) == 288500
    assert len({h for r in tr for h in r.hash_ids}) == 182790
    assert all(r.hash_ids[0] == 0 for r in tr)
    assert all(r.block_tokens == 512 and r.tenant == "" for r in tr)
