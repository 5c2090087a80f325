"""The results convention (quillcache.results): hand-computed rows, the exact CSV text, a round
trip through the CSV, NaN where there is no usable baseline, and the spread's order statistics."""

import csv
import math

import pytest

from quillcache.results import SUMMARY_COLUMNS, SummaryRow, results_dir, spread, write_raw, write_summary

HEADER = "metric,subject,value,unit,baseline,baseline_value,ratio,n,p10,p90,notes"


def test_summary_csv_text_is_the_hand_computed_rows(tmp_path):
    rows = [
        # 10 ops/s against 4 ops/s: ratio 10 / 4 = 2.5
        SummaryRow(metric="throughput", subject="fast", value=10.0, unit="ops/s", baseline="ref", baseline_value=4.0,
                   n=5, notes="median of 5"),
        # no baseline: ratio and baseline_value are NaN, never a made-up 1 or 0
        SummaryRow(metric="latency", subject="fast", value=3.0, unit="ns"),
    ]
    path = write_summary("unit", rows, root=tmp_path, profile="quick")
    assert path == tmp_path / "unit" / "summary.csv"
    assert path.read_text().splitlines() == [
        HEADER,
        "throughput,fast,10.0,ops/s,ref,4.0,2.5,5,nan,nan,median of 5",
        "latency,fast,3.0,ns,,nan,nan,1,nan,nan,",
    ]
    assert ",".join(SUMMARY_COLUMNS) == HEADER


def test_summary_round_trips_through_the_csv(tmp_path):
    rows = [
        SummaryRow(metric="put_GBps_2MiB", subject="store, put", value=1 / 3, unit="GB/s", baseline="memcpy",
                   baseline_value=2 / 3, n=7, notes='quoted "note", with comma'),
        SummaryRow(metric="p99", subject="x", value=1e-9, unit="s"),
    ]
    with open(write_summary("rt", rows, root=tmp_path, profile="full"), newline="") as fh:
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


# ---- the tidy schema: typed parameter columns, run metadata, anchors, refusals ---------------------


def test_parameters_become_typed_columns_and_capacity_sorts_as_a_number(tmp_path):
    from quillcache.results import read_summary

    rows = [SummaryRow(metric="hit_rate", subject="lru", value=v, unit="fraction",
                       params={"capacity_blocks": cap, "trace": "t", "warm": cap > 5000})
            for cap, v in ((10_000, 0.2), (1_000, 0.05), (30_000, 0.3))]
    rows.append(SummaryRow(metric="hit_rate", subject="lru", value=0.4, unit="fraction", params={"trace": "t"}))
    path = write_summary("typed", rows, root=tmp_path, profile="quick")
    assert path.read_text().splitlines()[0] == HEADER + ",capacity_blocks,trace,warm"
    df = read_summary("typed", tmp_path)
    assert str(df["capacity_blocks"].dtype) == "Int64" and str(df["warm"].dtype) == "boolean"
    # "1k" < "10k" < "30k" as numbers, not as text; the unlimited row (no capacity) is NA
    assert df.dropna(subset=["capacity_blocks"]).sort_values("capacity_blocks")["value"].tolist() == [0.05, 0.2, 0.3]
    assert df["capacity_blocks"].isna().tolist() == [False, False, False, True]
    assert set(df["study"]) == {"typed"} and set(df["profile"]) == {"quick"}


def test_meta_records_profile_commit_and_machine(tmp_path):
    import json

    from quillcache.results import read_meta

    write_summary("m", [SummaryRow(metric="x", subject="y", value=1.0, unit="u")], root=tmp_path, profile="full")
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert meta["profile"] == "full" and meta["study"] == "m"
    assert meta["cpu_count"] >= 1 and meta["cpu_model"] and meta["python"].count(".") == 2
    assert len(meta["git_commit"]) in (40, len("unknown"))
    assert read_meta("m", tmp_path).profile == "full"
    with pytest.raises(ValueError, match="profile 'fast' is not one of quick, full, custom"):
        write_summary("m", [], root=tmp_path, profile="fast")


def test_anchors_live_apart_from_the_same_run_baseline(tmp_path):
    from quillcache.results import Anchor, read_anchors, read_summary

    write_summary("a", [SummaryRow(metric="gain", subject="pool", value=2.5, unit="x")], root=tmp_path,
                  profile="quick", anchors=[Anchor(metric="gain", subject="paper", value=2.22, unit="x",
                                                   source="Mooncake (FAST '25)")])
    assert read_summary("a", tmp_path)["baseline"].tolist() == [""]
    anchors = read_anchors("a", tmp_path)
    assert anchors[["metric", "value", "source"]].values.tolist() == [["gain", 2.22, "Mooncake (FAST '25)"]]
    with pytest.raises(ValueError, match="needs a source"):
        Anchor(metric="gain", subject="paper", value=1.0, unit="x", source=" ")


@pytest.mark.parametrize("row, message", [
    (dict(metric="hit_rate@1k"), "a metric name holds no parameter"),
    (dict(params={"Capacity": 1}), "lower_snake_case"),
    (dict(params={"baseline": 1}), "reserved results column"),
    (dict(params={"cap": math.inf}), "not a finite number"),
    (dict(params={"cap": [1, 2]}), "use int, float, str or bool"),
])
def test_bad_rows_are_refused_with_a_message_naming_them(tmp_path, row, message):
    kw = dict(metric="m", subject="s", value=1.0, unit="u") | row
    with pytest.raises((ValueError, TypeError), match=message):
        write_summary("bad", [SummaryRow(**kw)], root=tmp_path, profile="quick")
    assert not (tmp_path / "bad" / "summary.csv").exists()


def test_notes_with_an_absolute_local_path_are_refused(tmp_path):
    from pathlib import Path

    here = str(Path.cwd().resolve())
    with pytest.raises(ValueError, match="absolute local path"):
        write_summary("p", [SummaryRow(metric="m", subject="s", value=1.0, unit="u", notes=f"ran {here}/x.py")],
                      root=tmp_path, profile="quick")


def test_readers_name_what_is_there_when_asked_for_what_is_not(tmp_path):
    from quillcache.results import ResultsNotFoundError, list_studies, read_raw, read_summary

    write_summary("one", [SummaryRow(metric="m", subject="s", value=1.0, unit="u")], root=tmp_path, profile="quick")
    write_raw("one", "cells.csv", ["a"], [(1,)], root=tmp_path)
    assert list_studies(tmp_path) == ["one"]
    with pytest.raises(ResultsNotFoundError, match=r"no study 'two' .*studies there: one"):
        read_summary("two", tmp_path)
    with pytest.raises(ResultsNotFoundError, match=r"no raw file 'raw' \(raw files: cells\)"):
        read_raw("one", "raw", tmp_path)
    assert read_raw("one", "cells", tmp_path)["a"].tolist() == [1]
    with pytest.raises(ValueError, match="one directory name"):
        read_summary("../etc", tmp_path)


def test_importing_the_results_api_loads_neither_pandas_nor_matplotlib():
    import subprocess
    import sys

    code = ("import sys, quillcache.results, quillcache; a = 'pandas' in sys.modules; "
            "quillcache.read_summary; print(a, 'pandas' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "False"]  # pandas only once a reader is used; matplotlib never
