"""Review fixes of the results API (quillcache.results) and the report's StudyView / formats:

- two writers of one study never share a temporary file, and summary.csv + meta.json are
  replaced together under the study's lock (a reader never sees one run's summary with the
  other run's metadata); a failed write leaves the old files and no temporary behind;
- write_summary -> read_summary keeps what was written ("007", 2.0, "nan", 2**53 + 1, ...), and
  StudyView selects by value (0 == 0.0; text and booleans exactly);
- spread() refuses NaN/inf and picks p10/p90 symmetrically;
- damaged results files are a clear error naming the file and what is wrong;
- the x / inv / fixed formats print 'n/a' for NaN (and inv for 0) instead of 'nanx' or a crash;
- write_raw / write_summary never write outside <root>/<study>/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import math
import random
import threading

import pytest

from experiments import report
from quillcache.results import (ResultsFormatError, SummaryRow, read_anchors, read_meta, read_summary, spread,
                                write_raw, write_summary)
from quillcache.results import writer as results_writer


def _rows(value: float, n: int = 3) -> list[SummaryRow]:
    return [SummaryRow(metric="m", subject=f"s{i}", value=value, unit="u") for i in range(n)]


# ---- 1. concurrent writers ----------------------------------------------------------------------


def test_a_reader_never_sees_one_runs_summary_with_the_other_runs_meta(tmp_path, monkeypatch):
    """A reader that comes while a writer has replaced summary.csv but not yet meta.json waits for
    the writer (study lock) and then reads the new pair, never new summary + old meta."""
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    seen: list = []
    readers: list[threading.Thread] = []
    real_replace = results_writer.os.replace

    def read() -> None:
        df = read_summary("st", tmp_path)
        seen.append((set(df["value"]), df["profile"].iloc[0]))

    def replace(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("summary.csv") and not readers:
            readers.append(threading.Thread(target=read))
            readers[0].start()
            readers[0].join(timeout=1.0)  # without the lock the reader finishes here, inside the writer's window

    monkeypatch.setattr(results_writer.os, "replace", replace)
    write_summary("st", _rows(2.0), root=tmp_path, profile="full")
    readers[0].join()
    assert seen == [({2.0}, "full")]


def test_concurrent_writers_of_one_study_leave_a_whole_consistent_pair(tmp_path):
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(profile: str, value: float) -> None:
        try:
            barrier.wait(timeout=10)
            write_summary("study", _rows(value, 1500), root=tmp_path, profile=profile)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    for _ in range(15):
        threads = [threading.Thread(target=run, args=("quick", 1.0)), threading.Thread(target=run, args=("full", 2.0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        df = read_summary("study", tmp_path)
        assert len(df) == 1500 and len(set(df["value"])) == 1
        assert (df["value"].iloc[0] == 1.0) == (df["profile"].iloc[0] == "quick")
    assert errors == []
    leftovers = sorted(p.name for p in (tmp_path / "study").iterdir())
    assert leftovers == [".lock", "meta.json", "summary.csv"]


def test_another_writers_temporary_file_is_neither_used_nor_clobbered(tmp_path):
    d = tmp_path / "st"
    d.mkdir()
    (d / "summary.csv.tmp").write_text("another writer's half-written summary\n")
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    assert (d / "summary.csv.tmp").read_text() == "another writer's half-written summary\n"
    assert read_summary("st", tmp_path)["value"].tolist() == [1.0, 1.0, 1.0]


def test_a_failed_write_keeps_the_old_results_and_leaves_no_temporary(tmp_path, monkeypatch):
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    before = {p.name: p.read_bytes() for p in (tmp_path / "st").iterdir()}

    def boom(self):
        raise RuntimeError("disk full")

    rows = _rows(2.0)
    monkeypatch.setattr(SummaryRow, "as_dict", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        write_summary("st", rows, root=tmp_path, profile="full")
    assert {p.name: p.read_bytes() for p in (tmp_path / "st").iterdir()} == before


# ---- 2. round trip and selection by value -------------------------------------------------------


def test_write_then_read_keeps_what_was_written(tmp_path):
    rows = [
        SummaryRow(metric="m", subject="a", value=1.0, unit="u", notes="nan",
                   params={"label": "nan", "code": "007", "ratio_param": 2.0, "seed": 2**53 + 1, "big": 2**70,
                           "warm": True, "mixed": 1, "word": "NA"}),
        SummaryRow(metric="m", subject="b", value=2.0, unit="u", notes="NA",
                   params={"label": "x", "code": "010", "ratio_param": 4.0, "warm": False, "mixed": 2.5,
                           "word": "null"}),
    ]
    write_summary("rt", rows, root=tmp_path, profile="custom")
    df = read_summary("rt", tmp_path)
    assert df["notes"].tolist() == ["nan", "NA"]
    assert df["label"].tolist() == ["nan", "x"] and df["word"].tolist() == ["NA", "null"]
    assert df["code"].tolist() == ["007", "010"]
    assert str(df["ratio_param"].dtype) == "float64" and df["ratio_param"].tolist() == [2.0, 4.0]
    assert str(df["seed"].dtype) == "Int64" and df["seed"][0] == 2**53 + 1 and df["seed"].isna().tolist() == [False,
                                                                                                            True]
    assert df["big"][0] == 2**70 and isinstance(df["big"][0], int)
    assert str(df["warm"].dtype) == "boolean" and df["warm"].tolist() == [True, False]
    assert str(df["mixed"].dtype) == "float64" and df["mixed"].tolist() == [1.0, 2.5]
    assert df["value"].tolist() == [1.0, 2.0] and str(df["n"].dtype) == "int64"
    write_summary("empty", [], root=tmp_path, profile="custom")
    e = read_summary("empty", tmp_path)
    assert e.shape == (0, 13) and str(e["value"].dtype) == "float64"


def test_anchors_round_trip_their_text_and_parameters(tmp_path):
    from quillcache.results import Anchor

    write_summary("a", _rows(1.0), root=tmp_path, profile="quick",
                  anchors=[Anchor(metric="m", subject="paper", value=2.0, unit="x", source="NA",
                                  notes="nan", params={"version": "1.10"})])
    a = read_anchors("a", tmp_path)
    assert a[["source", "notes", "version"]].values.tolist() == [["NA", "nan", "1.10"]]


def test_text_with_newlines_quotes_and_a_trailing_blank_line_reads_back(tmp_path):
    write_summary("t", [SummaryRow(metric="m", subject="a, \"b\"", value=1.0, unit="u", notes="two\nlines")],
                  root=tmp_path, profile="quick")
    path = tmp_path / "t" / "summary.csv"
    path.write_text(path.read_text() + "\n")  # as an editor may leave it
    df = read_summary("t", tmp_path)
    assert df[["subject", "notes"]].values.tolist() == [['a, "b"', "two\nlines"]]


@pytest.fixture
def view(tmp_path, monkeypatch):
    from experiments.studies import STUDIES, Study

    monkeypatch.setitem(STUDIES, "unit_sel", Study(name="unit_sel", module="experiments.report", title="Unit",
                                                   make_target="none"))
    write_summary("unit_sel", [
        SummaryRow(metric="m", subject="a", value=10.0, unit="u", params={"flip_rate": 0.0, "code": "007",
                                                                         "cap": 1000, "warm": True}),
        SummaryRow(metric="m", subject="a", value=20.0, unit="u", params={"flip_rate": 1.0, "code": "7",
                                                                         "warm": False}),
    ], root=tmp_path, profile="custom")
    return report.StudyView("unit_sel", str(tmp_path))


def test_study_view_selects_numbers_by_value(view):
    assert view.v("m", "a", flip_rate=0.0) == 10.0
    assert view.v("m", "a", flip_rate=0) == 10.0 and view.v("m", flip_rate=1) == 20.0
    assert view.v("m", cap=1000.0) == 10.0 and view.v("m", cap=None) == 20.0


def test_study_view_selects_text_and_booleans_exactly(view):
    assert view.v("m", code="007") == 10.0 and view.v("m", code="7") == 20.0
    assert view.rows("m", code=7) == [] and view.rows("m", cap="1000") == []
    assert view.v("m", warm=True) == 10.0 and view.rows("m", warm=1) == []
    assert len(view.rows("m", subject="a")) == 2


# ---- 3. spread ------------------------------------------------------------------------------------


@pytest.mark.parametrize("samples, bad", [
    ([math.nan, 1.0, 2.0, 3.0], "sample 0 is nan"),
    ([3.0, math.nan, 1.0, 2.0], "sample 1 is nan"),
    ([1.0, 2.0, 3.0, math.nan], "sample 3 is nan"),
    ([1.0, math.inf], "sample 1 is inf"),
    ([-math.inf, 1.0], "sample 0 is -inf"),
])
def test_spread_refuses_nan_and_inf_naming_the_sample(samples, bad):
    with pytest.raises(ValueError, match=bad):
        spread(samples)


def test_spread_picks_p10_and_p90_symmetrically_and_ignores_order():
    rng = random.Random(20240611)
    for n in range(1, 60):
        xs = list(range(n))
        s = spread(xs)
        assert s["p10"] == n - 1 - s["p90"], n  # p10's rank from the bottom == p90's rank from the top
        assert s["p10"] == math.floor(0.1 * (n - 1) + 0.5 - 1e-9), n  # nearest rank, a tie to the outer one
        shuffled = xs[:]
        rng.shuffle(shuffled)
        assert spread(shuffled) == s
    assert (spread(list(range(6)))["p10"], spread(list(range(6)))["p90"]) == (0, 5)
    assert (spread(list(range(16)))["p10"], spread(list(range(16)))["p90"]) == (1, 14)


# ---- 4. damaged files ---------------------------------------------------------------------------

HEADER = "metric,subject,value,unit,baseline,baseline_value,ratio,n,p10,p90,notes\n"
META = {"study": "x", "profile": "quick", "git_commit": "a", "git_dirty": False, "cpu_model": "c", "cpu_count": 1,
        "python": "3", "platform": "p", "date_utc": "d"}


@pytest.mark.parametrize("name, csv_text, meta, message", [
    ("empty_file", "", None, "summary.csv: the file is empty"),
    ("no_notes_col", HEADER.replace(",notes", "") + "m,a,1,u,,nan,nan,1,nan,nan\n", None, "missing columns notes"),
    ("text_value", HEADER + "m,a,oops,u,,nan,nan,1,nan,nan,\n", None, r"line 2, column 'value': 'oops' is not a num"),
    ("text_n", HEADER + "m,a,1.0,u,,nan,nan,1.5,nan,nan,\n", None, r"column 'n': '1.5' is not an integer"),
    ("short_row", HEADER + "m,a,1.0\n", None, "line 2 has 3 fields, the header 11"),
    ("meta_bad_profile", HEADER, json.dumps(META | {"profile": "weird"}), "meta.json: profile 'weird' is not one"),
    ("meta_bad_type", HEADER, json.dumps(META | {"cpu_count": "many"}), "meta.json: field 'cpu_count' is 'many'"),
    ("meta_list", HEADER, "[]", "meta.json: holds a JSON list, not an object"),
    ("meta_not_json", HEADER, "{", "meta.json: not valid JSON"),
])
def test_damaged_results_are_a_clear_error_naming_the_file(tmp_path, name, csv_text, meta, message):
    d = tmp_path / name
    d.mkdir()
    (d / "summary.csv").write_text(csv_text)
    if meta is not None:
        (d / "meta.json").write_text(meta)
    with pytest.raises(ResultsFormatError, match=message) as info:
        read_summary(name, tmp_path)
    assert str(d) in str(info.value)
    assert isinstance(info.value, ValueError)
    if meta is not None:
        with pytest.raises(ResultsFormatError, match=message):
            read_meta(name, tmp_path)
    assert (d / "summary.csv").read_text() == csv_text  # reading changes nothing


def test_damaged_anchors_name_the_file(tmp_path):
    write_summary("a", _rows(1.0), root=tmp_path, profile="quick")
    (tmp_path / "a" / "anchors.csv").write_text("metric,subject,value,unit,source,notes\nm,s,x1,u,src,\n")
    with pytest.raises(ResultsFormatError, match=r"anchors.csv: line 2, column 'value': 'x1' is not a number"):
        read_anchors("a", tmp_path)


# ---- 5. formats -----------------------------------------------------------------------------------


def test_ratio_formats_print_n_a_instead_of_nanx_or_crashing():
    f = report.FILTERS
    assert f["x"](math.nan) == "n/a" and f["x"](math.inf) == "n/a" and f["x"](24.87) == "24.9x"
    assert f["inv"](0) == "n/a" and f["inv"](0.0) == "n/a" and f["inv"](math.nan) == "n/a"
    assert f["inv"](0.04) == "25x"
    assert f["fixed"](math.nan) == "n/a" and f["fixed"](1.5) == "1.500"
    assert f["num"](math.nan) == f["pct"](math.nan) == "n/a"  # the formats agree on the marker


# ---- 6. nothing written outside the study's directory -------------------------------------------


@pytest.mark.parametrize("study, filename", [
    ("../escape", "raw.csv"),
    ("a/b", "raw.csv"),
    ("ABS", "raw.csv"),
    ("..", "raw.csv"),
    ("ok", "../raw.csv"),
    ("ok", "ABS"),
    ("ok", ".csv"),
    ("ok", "sub/raw.csv"),
])
def test_write_raw_refuses_paths_outside_the_study(tmp_path, study, filename):
    root = tmp_path / "root"
    root.mkdir()
    study = study.replace("ABS", str(tmp_path / "abs_study"))
    filename = filename.replace("ABS", str(tmp_path / "abs.csv"))
    with pytest.raises(ValueError) as info:
        write_raw(study, filename, ["a"], [(1,)], root=root)
    assert repr(study) in str(info.value) or repr(filename) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    assert [p for p in root.rglob("*") if p.is_file()] == []


def test_write_summary_refuses_a_study_name_that_is_a_path(tmp_path):
    root = tmp_path / "root"
    for name in ("../escape", str(tmp_path / "abs"), "a/b", ".."):
        with pytest.raises(ValueError, match="must be one directory name"):
            write_summary(name, _rows(1.0), root=root, profile="quick")
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["root"])
    assert not root.exists() or list(root.rglob("*")) == []
    # '' and '.' name the root itself (`quillcache hitrate --out .` stages its summary that way)
    assert write_summary(".", _rows(1.0), root=root, profile="quick") == root / "summary.csv"


def test_cli_out_given_as_a_relative_parent_still_writes_its_results(tmp_path):
    """``--out ..`` names a folder whose last path part is '..': the study name written into meta is the
    resolved folder's name (a bare '..' is refused as a study name since the writer refuses paths)."""
    import subprocess
    import sys

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 20,
                                           "hash_ids": ids})
                               for t, ids in ((0, [0, 1]), (100, [0, 1, 2]), (200, [0, 3]))) + "\n")
    work = tmp_path / "res" / "sub"
    work.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "quillcache", "hitrate", str(trace), "--policies", "lru",
                        "--capacities", "2", "--out", ".."], cwd=work, capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "res" / "summary.csv").is_file() and (tmp_path / "res" / "hitrate.csv").is_file()
    assert read_meta("res", tmp_path).study == "res"
