"""One look for every figure: a colour-blind-safe palette (Okabe-Ito), readable sizes, and
figures drawn with matplotlib's object API (``matplotlib.figure.Figure``) so that plotting never
selects or switches the caller's backend (a notebook's inline plots keep working).

Rules the studies' ``plot`` functions follow: one message per panel, axes labelled with units,
log scales where values span more than two decades, ours beside the same-run baseline.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

# Okabe & Ito (2008), in the order series are assigned.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
OURS = PALETTE[0]       # QuillCache's subject
BASELINE = PALETTE[1]   # the same-run baseline
BOUND = "#000000"       # an offline bound (Belady) or a reference line
GREY = "#999999"

RC = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
      "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False}


def figure(width_in: float = 7.0, height_in: float = 3.2, nrows: int = 1, ncols: int = 1, **kw):
    """A new Figure (not registered with pyplot) and its axes array (squeezed like subplots)."""
    import matplotlib

    with matplotlib.rc_context(RC):
        fig = Figure(figsize=(width_in, height_in), layout="constrained")
        axes = fig.subplots(nrows, ncols, **kw)
    return fig, axes


def style_axes(ax, *, xlabel: str | None = None, ylabel: str | None = None, title: str | None = None) -> None:
    import matplotlib

    with matplotlib.rc_context(RC):
        if xlabel:
            ax.set_xlabel(xlabel, fontsize=RC["axes.labelsize"])
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=RC["axes.labelsize"])
        if title:
            ax.set_title(title, fontsize=RC["axes.titlesize"])
        ax.tick_params(labelsize=RC["xtick.labelsize"])
        ax.spines["top"].set_visible(False)
        ax.spines["right"].set_visible(False)
        ax.grid(alpha=0.25, lw=0.6)


def save(fig, path: str | Path, dpi: int = 150) -> Path:
    """Write the figure as PNG (parent folders created) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    return path


def legend(ax, **kw):
    """A frameless legend in the house font size."""
    kw.setdefault("fontsize", RC["legend.fontsize"])
    kw.setdefault("frameon", False)
    return ax.legend(**kw)


_LOWER_IS_BETTER_UNITS = ("ns", "us", "µs", "ms", "s", "counts")


def lower_is_better(unit: str) -> bool:
    """Times (``ns``, ``us/plan``, ``ns/alloc``, ``s`` ...) and error counts are better when lower."""
    head = unit.split("/")[0].strip()
    return head in _LOWER_IS_BETTER_UNITS


def speedup_chart(df, title: str, path: str | Path, label=None) -> Path:
    """One panel: every row that has a same-run baseline, as the factor by which it beats that
    baseline (value/baseline for rates, baseline/value for times), log scale, 1x marked.
    ``label(row)`` names a bar (default: subject vs baseline, with the row's parameters)."""
    import numpy as np

    rows = df[(df["baseline"] != "") & (df["baseline_value"] > 0) & (df["value"] > 0)].reset_index(drop=True)
    fixed = {"study", "profile", "metric", "subject", "value", "unit", "baseline", "baseline_value", "ratio", "n",
             "p10", "p90", "notes"}
    params = [c for c in rows.columns if c not in fixed and rows[c].nunique(dropna=True) > 1]
    metric_shown = rows["metric"].nunique() > 1

    def default_label(r) -> str:
        extra = ", ".join(f"{p}={r[p]}" for p in params if str(r[p]) not in ("<NA>", "nan", ""))
        return ((f"{r['metric']}: " if metric_shown else "") + f"{r['subject']} vs {r['baseline']}"
                + (f" [{extra}]" if extra else ""))

    factors = [(float(r["baseline_value"]) / float(r["value"]) if lower_is_better(r["unit"])
                else float(r["value"]) / float(r["baseline_value"])) for _, r in rows.iterrows()]
    labels = [(label or default_label)(r) for _, r in rows.iterrows()]
    fig, ax = figure(8.0, 0.3 * len(rows) + 1.0)
    y = np.arange(len(rows))[::-1]
    ax.barh(y, factors, 0.6, color=[OURS if f >= 1 else BASELINE for f in factors])
    for yy, f in zip(y, factors):
        ax.annotate(f"{f:.3g}x", (f, yy), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    ax.axvline(1.0, color=BOUND, lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    style_axes(ax, xlabel="x better than the same-run baseline (log)")
    fig.suptitle(title, fontsize=RC["axes.titlesize"])
    return save(fig, path)
