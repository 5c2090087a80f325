"""Reading results for analysis: tidy pandas DataFrames, one row per measured cell.

``read_summary(study)`` returns the summary with ``study`` and ``profile`` columns added and
every parameter in a typed column of its own (numbers as nullable integers or floats, never as
text), so ``df[df.capacity_blocks >= 10_000]`` and ``df.sort_values('capacity_blocks')`` do what
they say. ``read_raw``, ``read_anchors`` and ``read_meta`` read the other files; ``list_studies``
names the studies present. Nothing here plots or changes matplotlib's state.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from quillcache.results.meta import RunMeta
from quillcache.results.schema import ANCHOR_COLUMNS, SUMMARY_COLUMNS
from quillcache.results.writer import results_root


class ResultsNotFoundError(FileNotFoundError):
    """A study or file that is not under the results root; the message lists what is."""


def list_studies(root: str | os.PathLike | None = None) -> list[str]:
    """Every study under the results root that has a ``summary.csv``, sorted."""
    base = results_root(root)
    return sorted(p.parent.name for p in base.glob("*/summary.csv"))


def _study_dir(study: str, root) -> Path:
    base = results_root(root)
    if Path(study).name != study or study in ("", ".", ".."):
        raise ValueError(f"study name {study!r} must be one directory name under {base}")
    d = base / study
    if not (d / "summary.csv").is_file():
        have = ", ".join(list_studies(root)) or "none"
        raise ResultsNotFoundError(f"no study {study!r} under {base} (studies there: {have}); "
                                   f"run `make experiments` or the study's module")
    return d


def _typed(df: pd.DataFrame, fixed: tuple[str, ...]) -> pd.DataFrame:
    params = [c for c in df.columns if c not in fixed]
    for c in params:
        col = df[c]
        if col.dtype == object:
            lowered = col.dropna().astype(str).str.lower()
            if len(lowered) and lowered.isin(["true", "false"]).all():
                df[c] = col.map(lambda v: pd.NA if pd.isna(v) else str(v).lower() == "true").astype("boolean")
                continue
            df[c] = col.astype("string")
        elif pd.api.types.is_float_dtype(col) and col.dropna().apply(float.is_integer).all() and col.notna().any():
            df[c] = col.astype("Int64")
    return df


def read_meta(study: str, root: str | os.PathLike | None = None) -> RunMeta | None:
    """The study's run metadata, or None for results written before metadata was recorded."""
    path = _study_dir(study, root) / "meta.json"
    if not path.is_file():
        return None
    return RunMeta.from_json(path.read_text(), origin=str(path))


def read_summary(study: str, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """The study's summary as a tidy DataFrame (see the module docstring)."""
    d = _study_dir(study, root)
    text = {c: str for c in ("metric", "subject", "unit", "baseline", "notes")}
    df = pd.read_csv(d / "summary.csv", keep_default_na=False, na_values=["", "nan", "NaN"], dtype=text)
    for c in text:
        df[c] = df[c].fillna("")
    df = _typed(df, SUMMARY_COLUMNS)
    meta = read_meta(study, root)
    df.insert(0, "profile", meta.profile if meta else "unknown")
    df.insert(0, "study", study)
    df.attrs["meta"] = meta
    return df


def read_anchors(study: str, root: str | os.PathLike | None = None) -> pd.DataFrame:
    """Figures reported outside this repository for the study (empty when it has none)."""
    path = _study_dir(study, root) / "anchors.csv"
    if not path.is_file():
        return pd.DataFrame(columns=list(ANCHOR_COLUMNS))
    text = {c: str for c in ("metric", "subject", "unit", "source", "notes")}
    df = pd.read_csv(path, keep_default_na=False, na_values=["", "nan"], dtype=text)
    for c in text:
        df[c] = df[c].fillna("")
    return _typed(df, ANCHOR_COLUMNS)


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
