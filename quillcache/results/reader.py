"""Reading results for analysis: tidy pandas DataFrames, one row per measured cell.

``read_summary(study)`` returns the summary with ``study`` and ``profile`` columns added and
every parameter in a typed column of its own, so ``df[df.capacity_blocks >= 10_000]`` and
``df.sort_values('capacity_blocks')`` do what they say. ``read_raw``, ``read_anchors`` and
``read_meta`` read the other files; ``list_studies`` names the studies present. Nothing here
plots or changes matplotlib's state.

What was written is what is read back (``write_summary`` -> ``read_summary``):
- the text columns (metric, subject, unit, baseline, notes; source for anchors) are the exact
  text written: ``"nan"``, ``"NA"`` and ``""`` stay text, never missing;
- the numeric columns (value, baseline_value, ratio, p10, p90 as floats, exactly as written;
  n as an integer) must hold numbers: anything else is an error naming the file, line and column;
- a parameter column's type is the one every written value of it has in the form the writer
  writes it (``str(int)``, ``repr(float)``, ``True``/``False``): integers (int64, nullable
  ``Int64`` where some rows lack the parameter, Python ints beyond 64 bits), floats (``2.0``
  stays a float; a column mixing ints and floats is float), booleans, else text (``"007"`` stays
  ``"007"``). A blank cell is a row without the parameter (missing), so an empty-text parameter
  reads back as missing, and a text parameter whose every value is written exactly like a number
  or a boolean (``"7"``) reads back as that number or boolean. ``"nan"`` and ``"inf"`` are text
  there: a float parameter is always finite (the writer refuses others).

A damaged file (empty, a fixed column missing, a reserved column such as ``study`` or
``profile`` in the header, a row of the wrong width, text in a numeric column, an unreadable
``meta.json``) raises ``ResultsFormatError`` naming the file and what is wrong. ``summary.csv``
(or ``anchors.csv``) and ``meta.json`` are read under the study's shared lock and the file's
digest (``table_sha256``: blank lines and line endings aside) checked against the one
``meta.json`` records, so they come from the same run: a pair
left by a write interrupted between its renames is a ``ResultsFormatError``. (A ``meta.json``
written before digests were recorded, or no ``meta.json``, is accepted unchecked.)
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from pathlib import Path

import pandas as pd

from quillcache.results.meta import RunMeta
from quillcache.results.schema import ANCHOR_COLUMNS, RESERVED_COLUMNS, SUMMARY_COLUMNS
from quillcache.results.writer import results_root, study_lock, study_path, table_sha256


class ResultsNotFoundError(FileNotFoundError):
    """A study or file that is not under the results root; the message lists what is."""


class ResultsFormatError(ValueError):
    """A results file that is damaged or not in the results schema; the message names the file
    and what is wrong."""


# The fixed columns' types; every other column is a parameter.
_TEXT = "text"
_FLOAT = "float"
_INT = "int"
_SUMMARY_TYPES = {"metric": _TEXT, "subject": _TEXT, "value": _FLOAT, "unit": _TEXT, "baseline": _TEXT,
                  "baseline_value": _FLOAT, "ratio": _FLOAT, "n": _INT, "p10": _FLOAT, "p90": _FLOAT,
                  "notes": _TEXT}
_ANCHOR_TYPES = {"metric": _TEXT, "subject": _TEXT, "value": _FLOAT, "unit": _TEXT, "source": _TEXT,
                 "notes": _TEXT}
assert tuple(_SUMMARY_TYPES) == SUMMARY_COLUMNS and tuple(_ANCHOR_TYPES) == ANCHOR_COLUMNS

_CANONICAL_INT = re.compile(r"^-?(0|[1-9][0-9]*)$")
_INT64 = (-(2**63), 2**63 - 1)


def list_studies(root: str | os.PathLike | None = None) -> list[str]:
    """Every study under the results root that has a ``summary.csv``, sorted."""
    base = results_root(root)
    return sorted(p.parent.name for p in base.glob("*/summary.csv"))


def _study_dir(study: str, root) -> Path:
    d = study_path(study, root)
    if not (d / "summary.csv").is_file():
        have = ", ".join(list_studies(root)) or "none"
        raise ResultsNotFoundError(f"no study {study!r} under {results_root(root)} (studies there: {have}); "
                                   f"run `make experiments` or the study's module")
    return d


def _is_float_text(t: str) -> bool:
    """Whether ``t`` is a finite float as the writer writes one (``repr``): never ``nan``/``inf``."""
    try:
        x = float(t)
    except ValueError:
        return False
    return math.isfinite(x) and repr(x) == t


def _param_column(cells: list[str]) -> pd.Series:
    """A parameter column from its written text (see the module docstring for the rules)."""
    present = [t for t in cells if t != ""]
    missing = len(present) < len(cells)
    if present and all(t in ("True", "False") for t in present):
        return pd.Series([pd.NA if t == "" else t == "True" for t in cells], dtype="boolean")
    if present and all(_CANONICAL_INT.match(t) for t in present):
        ints = [None if t == "" else int(t) for t in cells]
        if all(_INT64[0] <= v <= _INT64[1] for v in ints if v is not None):
            return pd.Series(ints, dtype="Int64" if missing else "int64")
        return pd.Series([pd.NA if v is None else v for v in ints], dtype=object)
    if present and all(_CANONICAL_INT.match(t) or _is_float_text(t) for t in present):
        return pd.Series([math.nan if t == "" else float(t) for t in cells], dtype="float64")
    return pd.Series([math.nan if t == "" else t for t in cells], dtype=str)


def _fixed_column(path: Path, name: str, kind: str, cells: list[str], line_of: list[int]) -> pd.Series:
    if kind == _TEXT:
        return pd.Series(cells, dtype=str)
    parse = float if kind == _FLOAT else int
    out = []
    for i, t in enumerate(cells):
        try:
            out.append(math.nan if kind == _FLOAT and t == "" else parse(t))
        except ValueError:
            raise ResultsFormatError(f"{path}: line {line_of[i]}, column {name!r}: {t!r} is not "
                                     f"{'a number' if kind == _FLOAT else 'an integer'}") from None
    return pd.Series(out, dtype="float64" if kind == _FLOAT else "int64")


def _read_table(path: Path, types: dict[str, str]) -> pd.DataFrame:
    """A summary or anchors CSV as typed columns (fixed columns per ``types``, then parameters);
    ``attrs['sha256']`` is the digest (``table_sha256``) of the text parsed."""
    try:
        text = path.read_bytes().decode("utf-8")
        reader = csv.reader(io.StringIO(text, newline=""))
        lines = [(reader.line_num, cells) for cells in reader if cells]  # (line it ends on, fields)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ResultsFormatError(f"{path}: not a readable CSV file ({exc})") from None
    if not lines:
        raise ResultsFormatError(f"{path}: the file is empty (expected a header line with the columns "
                                 f"{','.join(types)})")
    header, numbered = lines[0][1], lines[1:]
    missing = [c for c in types if c not in header]
    if missing:
        raise ResultsFormatError(f"{path}: missing columns {', '.join(missing)} (header: {','.join(header)})")
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup or "" in header:
        raise ResultsFormatError(f"{path}: the header has "
                                 f"{'repeated columns ' + ', '.join(dup) if dup else 'a blank column name'}")
    reserved = sorted(c for c in header if c in RESERVED_COLUMNS and c not in types)
    if reserved:
        raise ResultsFormatError(f"{path}: the header has the reserved columns {', '.join(reserved)} "
                                 f"(the reader adds study and profile; a parameter may not take a fixed column's name)")
    for line, cells in numbered:
        if len(cells) != len(header):
            raise ResultsFormatError(f"{path}: line {line} has {len(cells)} fields, the header {len(header)}")
    body = [cells for _, cells in numbered]
    line_of = [line for line, _ in numbered]
    columns = {}
    for j, name in enumerate(header):
        cells = [row[j] for row in body]
        columns[name] = (_fixed_column(path, name, types[name], cells, line_of) if name in types
                         else _param_column(cells))
    order = [*types, *(c for c in header if c not in types)]
    df = pd.DataFrame({c: columns[c] for c in order}, index=pd.RangeIndex(len(body)))
    df.attrs["sha256"] = table_sha256(text)
    return df


def _check_digest(path: Path, digest: str | None, meta: RunMeta | None, recorded: str | None) -> None:
    """Refuse ``path`` (sha256 ``digest``; None: the file is absent) when ``meta.json`` recorded
    another digest for it (``recorded``; None: no such file). A meta without digests checks nothing."""
    if meta is None or meta.summary_sha256 is None or digest == recorded:
        return
    found = "is absent" if digest is None else f"has sha256 {digest[:12]}..."
    wanted = "none" if recorded is None else f"one with sha256 {recorded[:12]}..."
    raise ResultsFormatError(f"{path}: {found}, but {path.parent / 'meta.json'} records {wanted}: the two files "
                             f"come from different runs (a write was interrupted); run the study again")


def _meta_from(path: Path) -> RunMeta | None:
    if not path.is_file():
        return None
    try:
        return RunMeta.from_json(path.read_text(encoding="utf-8"), origin=str(path))
    except UnicodeDecodeError as exc:
        raise ResultsFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except ValueError as exc:
        raise ResultsFormatError(str(exc)) from None


def read_meta(study: str, root: str | os.PathLike | None = None) -> RunMeta | None:
    """The study's run metadata, or None for results written before metadata was recorded."""
    d = _study_dir(study, root)
    with study_lock(d, shared=True):
        return _meta_from(d / "meta.json")


def read_summary(study: str, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """The study's summary as a tidy DataFrame (see the module docstring)."""
    d = _study_dir(study, root)
    with study_lock(d, shared=True):  # summary and meta of the same run
        df = _read_table(d / "summary.csv", _SUMMARY_TYPES)
        meta = _meta_from(d / "meta.json")
    _check_digest(d / "summary.csv", df.attrs.pop("sha256"), meta, meta and meta.summary_sha256)
    df.insert(0, "profile", pd.Series([meta.profile if meta else "unknown"] * len(df), dtype=str))
    df.insert(0, "study", pd.Series([study] * len(df), dtype=str))
    df.attrs["meta"] = meta
    return df


def read_anchors(study: str, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """Figures reported outside this repository for the study (empty when it has none), read with
    ``meta.json`` under the study's lock and checked against it; ``attrs['meta']`` is that run's
    metadata (as ``read_summary``'s: equal metadata means the same run)."""
    d = _study_dir(study, root)
    path = d / "anchors.csv"
    with study_lock(d, shared=True):
        df = _read_table(path, _ANCHOR_TYPES) if path.is_file() else pd.DataFrame(columns=list(ANCHOR_COLUMNS))
        meta = _meta_from(d / "meta.json")
    _check_digest(path, df.attrs.pop("sha256", None), meta, meta and meta.anchors_sha256)
    df.attrs["meta"] = meta
    return df


def read_raw(study: str, name: str, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """A raw file of the study (``name`` with or without ``.csv``; a Parquet twin is preferred)."""
    d = _study_dir(study, root)
    stem = name[:-4] if name.endswith(".csv") else name
    if Path(stem).name != stem or not stem:
        raise ValueError(f"raw file name {name!r} must be a file name inside results/{study}/")
    if (d / f"{stem}.parquet").is_file():
        try:
            return pd.read_parquet(d / f"{stem}.parquet")
        except ImportError:
            pass
    if not (d / f"{stem}.csv").is_file():
        have = ", ".join(sorted(p.stem for p in d.glob("*.csv") if p.stem not in ("summary", "anchors"))) or "none"
        raise ResultsNotFoundError(f"results/{study} has no raw file {stem!r} (raw files: {have})")
    return pd.read_csv(d / f"{stem}.csv")


def read_all(root: str | os.PathLike | None = None) -> pd.DataFrame:
    """Every study's summary in one frame (parameter columns are the union; blank where absent)."""
    frames = [read_summary(s, root) for s in list_studies(root)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["study", "profile",
                                                                                     *SUMMARY_COLUMNS])
