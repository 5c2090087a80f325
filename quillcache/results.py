"""The results convention shared by every study and benchmark.

Each study writes ``results/<name>/summary.csv`` with exactly the columns in
``SUMMARY_COLUMNS`` (``ratio = value / baseline_value``), plus any raw CSVs beside it.
Plots and the report read only these files. ``print_table(rows)`` shows the same rows on the
terminal (one table layout for every study; columns that are empty in every row are left out).
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Iterable, Sequence

SUMMARY_COLUMNS = ("metric", "subject", "value", "unit", "baseline", "baseline_value", "ratio", "n", "notes")


@dataclass(frozen=True, kw_only=True)
class SummaryRow:
    """One measured figure, with the baseline it was measured against in the same run."""

    metric: str
    subject: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float = math.nan
    n: int = 1
    notes: str = ""

    @property
    def ratio(self) -> float:
        if not self.baseline or not math.isfinite(self.baseline_value) or self.baseline_value == 0:
            return math.nan
        return self.value / self.baseline_value

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return {k: d[k] for k in SUMMARY_COLUMNS}


def results_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """``<root>/<name>``, created; root defaults to $QUILLCACHE_RESULTS or ./results."""
    base = Path(root or os.environ.get("QUILLCACHE_RESULTS", "results"))
    out = base / name
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_summary(name: str, rows: Iterable[SummaryRow], root: str | os.PathLike | None = None) -> Path:
    """Write ``results/<name>/summary.csv`` and return its path."""
    path = results_dir(name, root) / "summary.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for row in rows:
            w.writerow(row.as_dict())
    return path


def write_raw(name: str, filename: str, header: Sequence[str], records: Iterable[Sequence], root=None) -> Path:
    """Write a raw CSV beside the summary."""
    path = results_dir(name, root) / filename
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(records)
    return path


def spread(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max, p10, p90 of repeated measurements (quote the median)."""
    s = sorted(samples)
    if not s:
        raise ValueError("spread() needs at least one sample")

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]

    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "p10": q(0.1), "p90": q(0.9)}


def _fmt(v: float) -> str:
    """Four significant digits; thousands separators for large magnitudes; NaN as blank."""
    if not math.isfinite(v):
        return "" if math.isnan(v) else str(v)
    if abs(v) >= 1e5:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def print_table(rows: Sequence[SummaryRow], *, title: str | None = None, file: IO[str] | None = None) -> None:
    """Print summary rows as one table (rich): metric, subject, value, unit, baseline, its value,
    ratio, n and notes, leaving out the columns that are empty in every row."""
    from rich.console import Console
    from rich.table import Table

    out = file if file is not None else sys.stdout
    columns: list[tuple[str, str, list[str]]] = [  # (header, justify, cells)
        ("metric", "left", [r.metric for r in rows]),
        ("subject", "left", [r.subject for r in rows]),
        ("value", "right", [_fmt(r.value) for r in rows]),
        ("unit", "left", [r.unit for r in rows]),
        ("baseline", "left", [r.baseline for r in rows]),
        ("baseline value", "right", [_fmt(r.baseline_value) if r.baseline else "" for r in rows]),
        ("ratio", "right", [f"{r.ratio:.3g}x" if math.isfinite(r.ratio) else "" for r in rows]),
        ("n", "right", [str(r.n) for r in rows]),
        ("notes", "left", [r.notes for r in rows]),
    ]
    shown = [c for c in columns if any(c[2])]
    table = Table(title=title, show_edge=False, pad_edge=False, box=None, header_style="bold")
    for header, justify, _ in shown:
        table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for i in range(len(rows)):
        table.add_row(*(cells[i] for _, _, cells in shown))
    console = Console(file=out, width=None if getattr(out, "isatty", lambda: False)() else 200)
    console.print(table)
