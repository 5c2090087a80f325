"""Regenerate every figure from ``results/*/summary.csv`` (``make figures``).

Plotting reads only ``results/``; it never re-runs an experiment. One PNG per study in
``paper/figures/``. A study whose figure needs its own layout registers a ``plot(results_root,
out_dir)`` function in ``STUDY_PLOTS``; every other study gets the generic figure: for each
metric that has a baseline, the subject's value next to the baseline's value (log scale, ratio
annotated).
"""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


# study name -> "module:function(results_root, out_dir) -> Path | list[Path]"
STUDY_PLOTS: dict[str, str] = {
    "crash": "experiments.crash_study:plot",
    "safety": "experiments.safety_study:plot_into",
    "hitrate": "experiments.hitrate_study:plot",
    "replay": "experiments.replay_study:plot",
}


def load_summaries(results_root: Path) -> dict[str, pd.DataFrame]:
    """Every ``<study>/summary.csv`` under results_root, keyed by study name."""
    out = {}
    for path in sorted(results_root.glob("*/summary.csv")):
        out[path.parent.name] = pd.read_csv(path)
    return out


def plot_study(name: str, df: pd.DataFrame, out_dir: Path) -> Path | None:
    """One panel per unit; in each, every subject's value beside its same-run baseline (log scale)."""
    comp = df[df["baseline"].notna() & df["baseline_value"].notna() & (df["baseline_value"] > 0) & (df["value"] > 0)]
    if comp.empty:
        return None
    units = list(dict.fromkeys(comp["unit"]))
    fig, axes = plt.subplots(len(units), 1, figsize=(max(7, 0.9 * comp.groupby("unit").size().max() + 3), 3.2 * len(units)),
                             squeeze=False)
    w = 0.38
    for ax, unit in zip(axes[:, 0], units):
        part = comp[comp["unit"] == unit]
        xs = list(range(len(part)))
        ax.bar([x - w / 2 for x in xs], part["value"], w, label="subject")
        ax.bar([x + w / 2 for x in xs], part["baseline_value"], w, label="baseline (same run)")
        for x, (v, r) in enumerate(zip(part["value"], part["ratio"])):
            if isinstance(r, float) and math.isfinite(r):
                ax.annotate(f"{r:.3g}×", (x - w / 2, v), ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{m}\n{s} vs {b}" for m, s, b in zip(part["metric"], part["subject"], part["baseline"])],
                           fontsize=6, rotation=30, ha="right")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    axes[0, 0].set_title(f"{name} (ratio = subject / baseline)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results-root", default="results")
    ap.add_argument("--out", default="paper/figures")
    args = ap.parse_args(argv)
    studies = load_summaries(Path(args.results_root))
    if not studies:
        raise SystemExit(f"no results/*/summary.csv under {args.results_root!r}; run `make experiments` first")
    for name, df in studies.items():
        target = STUDY_PLOTS.get(name)
        if target is not None:
            module, fn = target.split(":")
            path = getattr(importlib.import_module(module), fn)(Path(args.results_root), Path(args.out))
        else:
            path = plot_study(name, df, Path(args.out))
        print(f"{name}: {path if path else 'no baseline comparisons to plot'}")


if __name__ == "__main__":
    main()
