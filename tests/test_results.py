import csv
import math

import pytest

from quillcache.results import SUMMARY_COLUMNS, SummaryRow, spread, write_raw, write_summary


def test_summary_roundtrip(tmp_path):
    rows = [
        SummaryRow(metric="throughput", subject="fast", value=10.0, unit="ops/s", baseline="ref", baseline_value=2.0, n=5),
        SummaryRow(metric="latency", subject="fast", value=3.0, unit="ns"),
    ]
    path = write_summary("unit", rows, root=tmp_path)
    assert path == tmp_path / "unit" / "summary.csv"
    with open(path) as fh:
        got = list(csv.DictReader(fh))
    assert tuple(got[0].keys()) == SUMMARY_COLUMNS
    assert float(got[0]["ratio"]) == 5.0
    assert math.isnan(float(got[1]["ratio"]))
    raw = write_raw("unit", "raw.csv", ["a", "b"], [(1, 2), (3, 4)], root=tmp_path)
    assert raw.read_text().splitlines() == ["a,b", "1,2", "3,4"]


def test_spread():
    s = spread([5, 1, 3, 2, 4])
    assert s["median"] == 3 and s["min"] == 1 and s["max"] == 5
    with pytest.raises(ValueError):
        spread([])
