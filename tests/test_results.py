"""The results convention (quillcache.results): hand-computed rows, the exact CSV text, a round
trip through the CSV, NaN where there is no usable baseline, and the spread's order statistics."""

import csv
import math

import pytest

from quillcache.results import SUMMARY_COLUMNS, SummaryRow, results_dir, spread, write_raw, write_summary

HEADER = "metric,subject,value,unit,baseline,baseline_value,ratio,n,notes"


def test_summary_csv_text_is_the_hand_computed_rows(tmp_path):
    rows = [
        # 10 ops/s against 4 ops/s: ratio 10 / 4 = 2.5
        SummaryRow(metric="throughput", subject="fast", value=10.0, unit="ops/s", baseline="ref", baseline_value=4.0,
                   n=5, notes="median of 5"),
        # no baseline: ratio and baseline_value are NaN, never a made-up 1 or 0
        SummaryRow(metric="latency", subject="fast", value=3.0, unit="ns"),
    ]
    path = write_summary("unit", rows, root=tmp_path)
    assert path == tmp_path / "unit" / "summary.csv"
    assert path.read_text().splitlines() == [
        HEADER,
        "throughput,fast,10.0,ops/s,ref,4.0,2.5,5,median of 5",
        "latency,fast,3.0,ns,,nan,nan,1,",
    ]
    assert ",".join(SUMMARY_COLUMNS) == HEADER


def test_summary_round_trips_through_the_csv(tmp_path):
    rows = [
        SummaryRow(metric="put_GBps_2MiB", subject="store, put", value=1 / 3, unit="GB/s", baseline="memcpy",
                   baseline_value=2 / 3, n=7, notes='quoted "note", with comma'),
        SummaryRow(metric="p99", subject="x", value=1e-9, unit="s"),
    ]
    with open(write_summary("rt", rows, root=tmp_path), newline="") as fh:
        got = list(csv.DictReader(fh))
    back = [SummaryRow(metric=r["metric"], subject=r["subject"], value=float(r["value"]), unit=r["unit"],
                       baseline=r["baseline"], baseline_value=float(r["baseline_value"]), n=int(r["n"]),
                       notes=r["notes"]) for r in got]
    assert back[0] == rows[0]  # floats are written exactly (repr), text with commas and quotes survives
    assert (back[1].metric, back[1].value, back[1].baseline) == ("p99", 1e-9, "")
    assert math.isnan(back[1].baseline_value)
    assert float(got[0]["ratio"]) == 0.5  # (1/3) / (2/3)


@pytest.mark.parametrize("baseline, baseline_value", [
    ("", 4.0),             # a value without a named baseline is no comparison
    ("ref", math.nan),     # a named baseline that was not measured
    ("ref", 0.0),          # division by zero is no ratio
    ("ref", math.inf),
])
def test_no_usable_baseline_gives_nan_ratio(baseline, baseline_value):
    row = SummaryRow(metric="m", subject="s", value=2.0, unit="x", baseline=baseline, baseline_value=baseline_value)
    assert math.isnan(row.ratio) and math.isnan(row.as_dict()["ratio"])
    assert list(row.as_dict()) == list(SUMMARY_COLUMNS)


def test_raw_csv_and_results_root(tmp_path, monkeypatch):
    raw = write_raw("unit", "raw.csv", ["a", "b"], [(1, 2), (3, 4)], root=tmp_path)
    assert raw.read_text().splitlines() == ["a,b", "1,2", "3,4"]
    monkeypatch.setenv("QUILLCACHE_RESULTS", str(tmp_path / "elsewhere"))
    assert results_dir("study") == tmp_path / "elsewhere" / "study" and (tmp_path / "elsewhere" / "study").is_dir()


def test_spread_order_statistics():
    s = spread([5, 1, 3, 2, 4])
    assert (s["median"], s["min"], s["max"], s["p10"], s["p90"]) == (3, 1, 5, 1, 5)
    # 0..10: p10 is the 2nd smallest, p90 the 2nd largest (index round(0.1 * 10) = 1, round(0.9 * 10) = 9)
    s = spread(list(range(10, -1, -1)))
    assert (s["median"], s["p10"], s["p90"]) == (5, 1, 9)
    assert spread([4, 1, 3, 2])["median"] == 2.5  # even count: mean of the two middle samples
    with pytest.raises(ValueError):
        spread([])


def test_print_table_shows_every_row_and_drops_empty_columns():
    import io

    from quillcache.results import print_table

    rows = [
        SummaryRow(metric="throughput", subject="fast", value=1_234_567.0, unit="ops/s", baseline="ref",
                   baseline_value=4.0, n=5, notes="median of 5"),
        SummaryRow(metric="latency", subject="slow", value=0.012345, unit="ns"),
    ]
    buf = io.StringIO()
    print_table(rows, title="unit", file=buf)
    lines = buf.getvalue().splitlines()
    header = next(line for line in lines if "metric" in line)
    assert header.split() == ["metric", "subject", "value", "unit", "baseline", "baseline", "value", "ratio", "n",
                              "notes"]
    fast = next(line for line in lines if "throughput" in line).split()
    # 1,234,567 / 4 = 308,641.75 -> ratio 3.09e+05 (three significant digits)
    assert fast == ["throughput", "fast", "1,234,567", "ops/s", "ref", "4", "3.09e+05x", "5", "median", "of", "5"]
    slow = next(line for line in lines if "latency" in line).split()
    assert slow == ["latency", "slow", "0.01235", "ns", "1"]  # no baseline: blank, not nan
    buf = io.StringIO()
    print_table(rows[1:], file=buf)  # no row has a baseline or notes: those columns are left out
    assert next(line for line in buf.getvalue().splitlines() if "metric" in line).split() == [
        "metric", "subject", "value", "unit", "n"]
