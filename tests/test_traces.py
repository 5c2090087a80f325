import json

import pytest

from quillcache.traces import TraceError, default_trace_path, load_trace


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_loads_valid_trace(tmp_path):
    p = _write(tmp_path, [
        json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}),
        json.dumps({"timestamp": 3, "input_length": 512, "output_length": 1, "hash_ids": [0]}),
    ])
    tr = load_trace(p)
    assert [r.hash_ids for r in tr] == [(0, 1), (0,)]
    assert tr[1].timestamp_ms == 3


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


def test_unsorted_and_missing(tmp_path):
    a = json.dumps({"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [0]})
    b = json.dumps({"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [0]})
    with pytest.raises(TraceError, match="sorted"):
        load_trace(_write(tmp_path, [a, b]))
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")


@pytest.mark.skipif(not default_trace_path().exists(), reason="shared Mooncake trace not present")
def test_shared_mooncake_trace_facts():
    tr = load_trace()
    assert len(tr) == 12031
    assert sum(len(r.hash_ids) for r in tr) == 288500
    assert len({h for r in tr for h in r.hash_ids}) == 182790
    assert all(r.hash_ids[0] == 0 for r in tr)
