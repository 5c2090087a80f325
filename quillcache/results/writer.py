"""Writing a study's results: ``results/<study>/summary.csv``, ``meta.json``, ``anchors.csv``
and raw CSVs beside them.

``summary.csv`` has the fixed ``SUMMARY_COLUMNS`` followed by one column per parameter used by
any row (sorted by name; blank where a row does not have it). Floats are written exactly
(``repr``). A write refuses, naming the row, a metric that packs a parameter (``@``) and any
text holding an absolute path of this machine (the repository or home directory), so committed
results never depend on where they were produced.
"""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

from quillcache.results.meta import collect
from quillcache.results.schema import ANCHOR_COLUMNS, SUMMARY_COLUMNS, Anchor, SummaryRow

_REPO_ROOT = Path(__file__).resolve().parents[2]


def results_root(root: str | os.PathLike | None = None) -> Path:
    """``root``, else $QUILLCACHE_RESULTS, else ./results."""
    return Path(root or os.environ.get("QUILLCACHE_RESULTS", "results"))


def results_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """``<root>/<name>``, created."""
    out = results_root(root) / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def _local_paths() -> list[str]:
    paths = {str(_REPO_ROOT), str(Path.cwd().resolve()), os.path.expanduser("~")}
    return sorted((p for p in paths if p not in ("", "/") and len(p) > 4), key=len, reverse=True)


def _check_text(where: str, text: str, local: list[str]) -> None:
    for p in local:
        if p + "/" in text or text.endswith(p):
            raise ValueError(f"{where} holds the absolute local path {p!r}; write a path relative to the "
                             f"repository (results must not depend on the machine): {text[:120]!r}")


def _check_rows(name: str, rows: Sequence[SummaryRow | Anchor]) -> None:
    local = _local_paths()
    for i, row in enumerate(rows):
        where = f"results/{name}: row {i} ({row.metric!r}, {row.subject!r})"
        if "@" in row.metric:
            raise ValueError(f"{where}: a metric name holds no parameter; put it in params (e.g. "
                             f"params={{'capacity_blocks': 1000}}) instead of {row.metric!r}")
        for text in (row.metric, row.subject, row.notes, *(v for v in row.params.values() if isinstance(v, str))):
            _check_text(where, text, local)


def _write_rows(path: Path, fixed: Sequence[str], rows: Sequence[SummaryRow | Anchor]) -> None:
    params = sorted({k for r in rows for k in r.params})
    clash = set(params) & set(fixed)
    if clash:
        raise ValueError(f"{path}: parameters {sorted(clash)} clash with fixed columns")
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[*fixed, *params], restval="")
        w.writeheader()
        for row in rows:
            w.writerow(row.as_dict())
    os.replace(tmp, path)


def write_summary(name: str, rows: Iterable[SummaryRow], root: str | os.PathLike | None = None, *,
                  profile: str, anchors: Iterable[Anchor] = (), started_at: float | None = None) -> Path:
    """Write ``<root>/<name>/summary.csv``, its ``meta.json`` (``profile`` is quick, full or
    custom; ``started_at`` a ``time.monotonic()`` stamp for the wall time) and, when given,
    ``anchors.csv``; return the summary's path."""
    rows = list(rows)
    anchors = list(anchors)
    _check_rows(name, rows)
    _check_rows(name, anchors)
    meta = collect(name, profile, wall_s=None if started_at is None else time.monotonic() - started_at)
    out = results_dir(name, root)
    path = out / "summary.csv"
    _write_rows(path, SUMMARY_COLUMNS, rows)
    (out / "meta.json").write_text(meta.to_json())
    if anchors:
        _write_rows(out / "anchors.csv", ANCHOR_COLUMNS, anchors)
    elif (out / "anchors.csv").exists():
        (out / "anchors.csv").unlink()
    return path


def write_raw(name: str, filename: str, header: Sequence[str], records: Iterable[Sequence], root=None) -> Path:
    """Write a raw CSV beside the summary."""
    if Path(filename).name != filename or not filename.endswith(".csv") or filename in ("summary.csv", "anchors.csv"):
        raise ValueError(f"raw file name {filename!r} must be a plain '<name>.csv' other than summary/anchors")
    path = results_dir(name, root) / filename
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(records)
    return path
