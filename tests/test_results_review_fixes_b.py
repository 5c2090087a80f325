"""Review fixes (round b) of the results API (quillcache.results) and the report's StudyView:

- a write_summary killed between its renames leaves files the readers refuse (meta.json records the
  sha256 of summary.csv / anchors.csv and is renamed last), and no staged temporary file;
- a reader takes the study's lock even where no writer ever created the lock file (a fresh checkout),
  and reads unlocked only where it cannot create it;
- StudyView's numbers, anchors and metadata are one run's;
- SummaryRow / Anchor refuse numbers the reader would refuse; "nan"/"inf" text parameters stay text;
- a header with a reserved column and spread() of an int beyond the float range are clear errors.
"""

from __future__ import annotations

import errno
import json
import math
import threading
from fractions import Fraction

import numpy as np
import pytest

from experiments import report
from quillcache.results import (Anchor, ResultsFormatError, RunMeta, SummaryRow, read_anchors, read_meta,
                                read_summary, spread, write_summary)
from quillcache.results import reader as results_reader
from quillcache.results import writer as results_writer


class Killed(BaseException):
    """Stands for SIGKILL / power loss at that point of a write."""


def _rows(value: float) -> list[SummaryRow]:
    return [SummaryRow(metric="m", subject="a", value=value, unit="u")]


def _anchor(value: float) -> list[Anchor]:
    return [Anchor(metric="m", subject="paper", value=value, unit="u", source="a paper")]


def _kill_at(monkeypatch, *, after: str | None = None, before: str | None = None) -> None:
    """Make the next write die right after renaming onto ``after`` (or right before renaming onto ``before``)."""
    real = results_writer.os.replace

    def replace(src, dst):
        if before and str(dst).endswith(before):
            raise Killed(dst)
        real(src, dst)
        if after and str(dst).endswith(after):
            raise Killed(dst)

    monkeypatch.setattr(results_writer.os, "replace", replace)


# ---- 4. a write killed between its renames ------------------------------------------------------


def test_a_summary_left_by_a_killed_write_is_refused_not_paired_with_the_old_meta(tmp_path, monkeypatch):
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    _kill_at(monkeypatch, after="summary.csv")
    with pytest.raises(Killed):
        write_summary("st", _rows(2.0), root=tmp_path, profile="full")
    monkeypatch.undo()
    with pytest.raises(ResultsFormatError, match=r"st/summary.csv: has sha256 \w+\.\.\., but .*st/meta.json "
                                                 r"records one with sha256 .*different runs"):
        read_summary("st", tmp_path)
    # the staged meta.json was not renamed: it is gone, not left beside the results
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == [".lock", "meta.json", "summary.csv"]
    write_summary("st", _rows(3.0), root=tmp_path, profile="full")  # the next run repairs the study
    df = read_summary("st", tmp_path)
    assert df["value"].tolist() == [3.0] and df["profile"].tolist() == ["full"]


def test_anchors_removed_by_a_killed_write_are_refused(tmp_path, monkeypatch):
    """Same rows, so summary.csv is byte-identical; the new run has no anchors and dies before meta.json."""
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick", anchors=_anchor(5.0))
    _kill_at(monkeypatch, before="meta.json")
    with pytest.raises(Killed):
        write_summary("st", _rows(1.0), root=tmp_path, profile="full")
    monkeypatch.undo()
    assert read_summary("st", tmp_path)["value"].tolist() == [1.0]
    with pytest.raises(ResultsFormatError, match=r"st/anchors.csv: is absent, but .*meta.json records one with"):
        read_anchors("st", tmp_path)
    assert not [p.name for p in (tmp_path / "st").iterdir() if p.name.endswith(".tmp")]


def test_anchors_of_another_run_are_refused(tmp_path, monkeypatch):
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick", anchors=_anchor(5.0))
    _kill_at(monkeypatch, after="anchors.csv")
    with pytest.raises(Killed):
        write_summary("st", _rows(1.0), root=tmp_path, profile="full", anchors=_anchor(6.0))
    monkeypatch.undo()
    with pytest.raises(ResultsFormatError, match=r"st/anchors.csv: has sha256 .* different runs"):
        read_anchors("st", tmp_path)


def test_results_written_before_digests_are_read_unchecked(tmp_path):
    write_summary("old", _rows(1.0), root=tmp_path, profile="full", anchors=_anchor(5.0))
    d = tmp_path / "old"
    meta = json.loads((d / "meta.json").read_text())
    assert set(meta) >= {"summary_sha256", "anchors_sha256"}
    for key in ("summary_sha256", "anchors_sha256"):
        del meta[key]
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "summary.csv").write_text((d / "summary.csv").read_text().replace(",1.0,", ",7.0,"))
    (d / "anchors.csv").unlink()
    assert read_summary("old", tmp_path)["value"].tolist() == [7.0]
    assert read_anchors("old", tmp_path).empty and read_meta("old", tmp_path).summary_sha256 is None


def test_line_endings_and_blank_lines_do_not_count_but_a_changed_cell_does(tmp_path):
    """A checkout that converted CRLF to LF (or an editor's trailing blank line) keeps the results readable."""
    write_summary("st", [SummaryRow(metric="m", subject="a", value=1.0, unit="u", notes="two\r\nlines")],
                  root=tmp_path, profile="quick", anchors=_anchor(5.0))
    for name in ("summary.csv", "anchors.csv"):
        path = tmp_path / "st" / name
        path.write_bytes(path.read_bytes().replace(b"\r\n", b"\n") + b"\n\n")
    assert read_summary("st", tmp_path)["value"].tolist() == [1.0] and read_anchors("st", tmp_path)["value"][0] == 5
    path = tmp_path / "st" / "summary.csv"
    path.write_text(path.read_text().replace(",u,", ",ms,"))
    with pytest.raises(ResultsFormatError, match="st/summary.csv: has sha256"):
        read_summary("st", tmp_path)


@pytest.mark.parametrize("edit, message", [
    ({"summary_sha256": "abc"}, "summary_sha256 'abc' is not a sha256 digest"),
    ({"anchors_sha256": 5}, "field 'anchors_sha256' is 5"),
    ({"summary_sha256": None, "anchors_sha256": "0" * 64}, "anchors_sha256 is set but summary_sha256 is not"),
    ({"drop": "anchors_sha256"}, "missing fields anchors_sha256"),
])
def test_a_damaged_digest_in_meta_is_named(tmp_path, edit, message):
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    path = tmp_path / "st" / "meta.json"
    meta = json.loads(path.read_text())
    if "drop" in edit:
        del meta[edit["drop"]]
    else:
        meta.update(edit)
    path.write_text(json.dumps(meta))
    with pytest.raises(ResultsFormatError, match=f"meta.json: .*{message}"):
        read_summary("st", tmp_path)


# ---- 5. the reader's lock where no writer created the lock file ----------------------------------


def test_a_reader_of_a_fresh_checkout_still_holds_off_a_writer(tmp_path, monkeypatch):
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    (tmp_path / "st" / ".lock").unlink()  # results/**/.lock is not committed
    real_read_table = results_reader._read_table
    writer: list[threading.Thread] = []

    def read_table(path, types):
        df = real_read_table(path, types)
        writer.append(threading.Thread(target=write_summary, args=("st", _rows(2.0), tmp_path),
                                       kwargs={"profile": "full"}))
        writer[0].start()
        writer[0].join(timeout=0.5)
        assert writer[0].is_alive(), "the writer replaced the files while the reader was reading them"
        return df

    monkeypatch.setattr(results_reader, "_read_table", read_table)
    df = read_summary("st", tmp_path)
    writer[0].join()
    assert df["value"].tolist() == [1.0] and df["profile"].tolist() == ["quick"]
    monkeypatch.undo()
    df = read_summary("st", tmp_path)
    assert df["value"].tolist() == [2.0] and df["profile"].tolist() == ["full"]


def test_a_reader_that_cannot_create_the_lock_file_reads_unlocked(tmp_path, monkeypatch):
    write_summary("st", _rows(1.0), root=tmp_path, profile="quick")
    (tmp_path / "st" / ".lock").unlink()
    real_open = results_writer.os.open

    def read_only_open(path, flags, *a):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(results_writer.os, "open", read_only_open)
    assert read_summary("st", tmp_path)["value"].tolist() == [1.0]
    assert read_anchors("st", tmp_path).empty


# ---- 6. StudyView reads one run ------------------------------------------------------------------


@pytest.fixture
def unit_study(tmp_path, monkeypatch):
    from experiments.studies import STUDIES, Study

    monkeypatch.setitem(STUDIES, "unit_one", Study(name="unit_one", module="experiments.report", title="One",
                                                   make_target="none"))
    write_summary("unit_one", _rows(1.0), root=tmp_path, profile="quick", anchors=_anchor(5.0))
    return tmp_path


def _consistent(v: report.StudyView) -> None:
    value, anchor = v.df["value"].iloc[0], v.anchor("m")
    assert {1.0: ("quick", 5.0), 2.0: ("full", 6.0)}[value] == (v.meta.profile, anchor)
    assert v.df["profile"].iloc[0] == v.meta.profile


@pytest.mark.parametrize("wrapped", ["read_summary", "read_anchors"])
def test_study_view_never_mixes_two_runs(unit_study, monkeypatch, wrapped):
    """Another process finishes a full run right after the view read its summary (or its anchors)."""
    real = getattr(report, wrapped)
    done: list[int] = []

    def read_then_a_run_finishes(name, root):
        out = real(name, root)
        if not done:
            done.append(1)
            write_summary(name, _rows(2.0), root=root, profile="full", anchors=_anchor(6.0))
        return out

    monkeypatch.setattr(report, wrapped, read_then_a_run_finishes)
    _consistent(report.StudyView("unit_one", str(unit_study)))


def test_study_view_gives_up_on_results_rewritten_on_every_read(unit_study, monkeypatch):
    real = report.read_summary

    def read_then_a_run_finishes(name, root):
        out = real(name, root)
        value = 2.0 if out["value"].iloc[0] == 1.0 else 1.0
        write_summary(name, _rows(value), root=root, profile="full", anchors=_anchor(value))
        return out

    monkeypatch.setattr(report, "read_summary", read_then_a_run_finishes)
    with pytest.raises(report.ReportDataError, match="unit_one: its results changed while being read"):
        report.StudyView("unit_one", str(unit_study))


# ---- 8. rows the reader would refuse are refused when made ----------------------------------------


@pytest.mark.parametrize("kw, error, field", [
    ({"n": 3.0}, TypeError, "n=3.0 is a float"),
    ({"n": True}, TypeError, "n=True is a bool"),
    ({"n": "3"}, TypeError, "n='3' is a str"),
    ({"value": "fast"}, TypeError, "value='fast' is a str"),
    ({"value": True}, TypeError, "value=True is a bool"),
    ({"baseline_value": None}, TypeError, "baseline_value=None"),
    ({"p10": "1"}, TypeError, "p10='1'"),
    ({"p90": Fraction(3, 2)}, ValueError, "p90 .type Fraction. does not fit a float or is not written as one"),
    ({"value": 10**400}, ValueError, "value .type int. does not fit a float"),
])
def test_summary_row_refuses_numbers_the_reader_refuses(kw, error, field):
    with pytest.raises(error, match=rf"SummaryRow\('m', 'a'\): {field}"):
        SummaryRow(**{"metric": "m", "subject": "a", "value": 1.0, "unit": "u", **kw})


def test_anchor_refuses_a_value_that_is_not_a_number():
    with pytest.raises(TypeError, match=r"Anchor\('m', 'paper'\): value='2x' is a str"):
        Anchor(metric="m", subject="paper", value="2x", unit="u", source="a paper")


def test_numbers_of_every_accepted_kind_read_back(tmp_path):
    rows = [SummaryRow(metric="m", subject="np", value=np.float64(0.1), unit="u", n=np.int64(7), p10=np.float32(0.5),
                       p90=3),
            SummaryRow(metric="m", subject="nan", value=math.nan, unit="u", baseline="b", baseline_value=math.inf)]
    write_summary("kinds", rows, root=tmp_path, profile="quick")
    df = read_summary("kinds", tmp_path)
    assert df["value"].iloc[0] == 0.1 and df["n"].tolist() == [7, 1] and df["p10"].iloc[0] == 0.5
    assert df["p90"].iloc[0] == 3.0 and math.isnan(df["value"].iloc[1]) and df["baseline_value"].iloc[1] == math.inf


# ---- 9. a text parameter that looks like a non-finite float ----------------------------------------


@pytest.mark.parametrize("labels", [["nan", "inf"], ["-inf"], ["1.5", "nan"]])
def test_text_parameters_nan_and_inf_stay_text(tmp_path, labels):
    rows = [SummaryRow(metric="m", subject=f"s{i}", value=1.0, unit="u", params={"label": lab})
            for i, lab in enumerate(labels)]
    write_summary("txt", rows, root=tmp_path, profile="quick")
    df = read_summary("txt", tmp_path)
    assert df["label"].tolist() == labels and not df["label"].isna().any()


# ---- 10. reserved header columns; spread() beyond the float range -------------------------------------


@pytest.mark.parametrize("column", ["profile", "study"])
def test_a_summary_with_a_reserved_column_is_a_format_error(tmp_path, column):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "summary.csv").write_text(
        f"metric,subject,value,unit,baseline,baseline_value,ratio,n,p10,p90,notes,{column}\n"
        "m,a,1.0,u,,nan,nan,1,nan,nan,,p\n")
    with pytest.raises(ResultsFormatError, match=f"x/summary.csv: the header has the reserved columns {column}"):
        read_summary("x", tmp_path)


@pytest.mark.parametrize("samples, index", [([1, 10**400], 1), ([10**5000, 2.0, 3.0], 0)])
def test_spread_refuses_a_sample_beyond_the_float_range(samples, index):
    with pytest.raises(ValueError, match=f"sample {index} .type int. is too large for a float"):
        spread(samples)


def test_meta_digests_round_trip():
    meta = RunMeta(study="s", profile="quick", git_commit="c", git_dirty=False, cpu_model="x", cpu_count=1,
                   python="3", platform="p", date_utc="d", summary_sha256="a" * 64, anchors_sha256=None)
    assert RunMeta.from_json(meta.to_json()) == meta
