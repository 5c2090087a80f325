"""One terminal table layout for every study's summary rows (rich)."""

from __future__ import annotations

import math
import sys
from typing import IO, Sequence

from quillcache.results.schema import SummaryRow


def fmt_number(v: float) -> str:
    """Four significant digits; thousands separators for large magnitudes; NaN as blank."""
    if isinstance(v, bool) or isinstance(v, int):
        return f"{v:,}" if abs(v) >= 100_000 else str(v)
    if not math.isfinite(v):
        return "" if math.isnan(v) else str(v)
    if abs(v) >= 1e5:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def print_table(rows: Sequence[SummaryRow], *, title: str | None = None, file: IO[str] | None = None) -> None:
    """Print summary rows as one table: metric, subject, the parameters, value, unit, p10/p90,
    baseline, its value, ratio, n and notes, leaving out the columns that are empty in every row."""
    from rich.console import Console
    from rich.table import Table

    out = file if file is not None else sys.stdout
    param_names = sorted({k for r in rows for k in r.params})
    columns: list[tuple[str, str, list[str]]] = [  # (header, justify, cells)
        ("metric", "left", [r.metric for r in rows]),
        ("subject", "left", [r.subject for r in rows]),
        *[(p, "right", [fmt_number(r.params[p]) if isinstance(r.params.get(p), (int, float)) else
                        str(r.params.get(p, "")) for r in rows]) for p in param_names],
        ("value", "right", [fmt_number(r.value) for r in rows]),
        ("unit", "left", [r.unit for r in rows]),
        ("p10", "right", [fmt_number(r.p10) for r in rows]),
        ("p90", "right", [fmt_number(r.p90) for r in rows]),
        ("baseline", "left", [r.baseline for r in rows]),
        ("baseline value", "right", [fmt_number(r.baseline_value) if r.baseline else "" for r in rows]),
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
