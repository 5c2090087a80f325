"""Router study on the full conversation-trace replay: Dynamo cost vs the baselines, same run.

Cells (each a full replay through the real planner, router, identity guard, ART index and store
tiers, with the engine model for compute; defaults of ``ReplayConfig`` otherwise: 4 Llama-3-8B
engines on H100, 8,192 DRAM + 32,768 SSD blocks per node, 2 s TTFT SLO, accounted bytes):

1. routers ``dynamo`` (the Dynamo KV-router cost with tier credits), ``round_robin``,
   ``least_loaded`` and ``prefix_affinity``, all with LRU tiers: TTFT p50/p99, goodput (requests/s
   meeting the SLO), SLO attainment and block hit rate. Baseline of every row: round-robin.
2. eviction policy ``quillhd`` vs ``lru`` under the Dynamo router: block hit rate and TTFT, with
   the default tiers and with small host tiers (``SMALL_TIERS``: 512 DRAM + 1,024 SSD blocks per
   node), where the pool must evict and the policy matters.

The replay is deterministic for its seed (every random choice is seeded), so a metric is one
number, not a sample; ``n`` is 1 and the wall time of each replay is in the notes. Writes
``results/replay/summary.csv`` (``write_summary``), ``results/replay/raw.csv`` (every cell's full
summary); ``plot`` draws ``paper/figures/replay.png`` from ``raw.csv`` only.
Quick mode replays the first ``QUICK_LIMIT`` requests; full mode the whole trace. Every row names
its trace (``trace``: the file's stem). A run on another trace than the shared conversation trace
(``default_trace_path()``, which ``$QUILLCACHE_TRACE`` may point at a copy of) is marked profile
``custom`` and its notes name the trace file, so it is never reported as the study's full run:
one given a ``trace=`` (the CLI's ``--trace``) that is not that file, or one whose trace file is not
named like the shared trace.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from experiments.hitrate_study import trace_label
from quillcache.harness import ReplayConfig, replay
from quillcache.results import SummaryRow, print_table, write_raw, write_summary
from quillcache.traces.loader import DEFAULT_TRACE, TraceError, default_trace_path, load_trace

NAME = "replay"
ROUTERS = ["dynamo", "round_robin", "least_loaded", "prefix_affinity"]
BASELINE = "round_robin"
METRICS = [("ttft_p50_s", "s"), ("ttft_p99_s", "s"), ("goodput_rps", "req/s"), ("slo_attainment", "fraction"),
           ("block_hit_rate", "fraction"), ("token_hit_rate", "fraction"),
           *((f"block_hit_rate_{t}", "fraction") for t in ("gpu", "dram", "ssd", "peer"))]  # where the hits came from
QUICK_LIMIT = 600
# Host tiers small enough that the pool must evict (the GPU tier is the engine model's).
SMALL_TIERS = {"dram_capacity_blocks": 512, "ssd_capacity_blocks": 1024}


def _cells() -> list[tuple[str, str, str]]:
    """(router, policy, tiers) for every replay of the study."""
    return ([(r, "lru", "default") for r in ROUTERS] + [("dynamo", "quillhd", "default")]
            + [("dynamo", p, "small") for p in ("lru", "quillhd")])


def _trace_file(path: Path) -> str:
    """The trace file for a results note: relative to the working directory when inside it, else
    its name (results never hold an absolute local path)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def run(quick: bool = False, results_root: str | None = None, trace: str | None = None) -> list[SummaryRow]:
    t_start = time.monotonic()
    path = Path(trace or default_trace_path())
    custom = (trace is not None and path.resolve() != default_trace_path().resolve()) \
        or trace_label(path) != DEFAULT_TRACE.stem
    reqs = load_trace(path, limit=QUICK_LIMIT if quick else None)
    raw: list[dict[str, object]] = []
    for router, policy, tiers in _cells():
        t0 = time.perf_counter()
        res = replay(reqs, ReplayConfig(router=router, policy=policy, **(SMALL_TIERS if tiers == "small" else {})))
        d = {**res.summary.as_dict(), "tiers": tiers}
        d["wall_s"] = time.perf_counter() - t0
        raw.append(d)
        print(f"  {router:>16} / {policy:<8} / {tiers:<7} {len(reqs)} requests in {d['wall_s']:.1f} s", flush=True)
    cols = list(raw[0])
    write_raw(NAME, "raw.csv", cols, [[d[c] for c in cols] for d in raw], root=results_root)
    rows: list[SummaryRow] = []

    def add(d: dict, base: dict | None) -> None:
        params = {"router": str(d["router"]), "policy": str(d["policy"]), "tiers": str(d["tiers"]),
                  "trace": trace_label(path), "requests": len(reqs), "engines": int(d["engines"]),
                  "dram_capacity_blocks": int(d["dram_capacity_blocks"]),
                  "ssd_capacity_blocks": int(d["ssd_capacity_blocks"])}
        for m, unit in METRICS:
            rows.append(SummaryRow(metric=m, subject=f"{d['router']}/{d['policy']}", value=float(d[m]), unit=unit,
                                   baseline=f"{base['router']}/{base['policy']}" if base else "",
                                   baseline_value=float(base[m]) if base else math.nan, n=1,
                                   notes=f"deterministic replay (seed 0); wall {d['wall_s']:.1f} s"
                                   + (f"; custom trace {_trace_file(path)}" if custom else ""), params=params))

    by = {(d["router"], d["policy"], d["tiers"]): d for d in raw}
    add(by[(BASELINE, "lru", "default")], None)  # the baseline cell itself
    for router in ROUTERS:
        if router != BASELINE:
            add(by[(router, "lru", "default")], by[(BASELINE, "lru", "default")])
    add(by[("dynamo", "quillhd", "default")], by[("dynamo", "lru", "default")])
    add(by[("dynamo", "lru", "small")], None)  # the small-tier baseline cell
    add(by[("dynamo", "quillhd", "small")], by[("dynamo", "lru", "small")])
    write_summary(NAME, rows, root=results_root, profile="custom" if custom else "quick" if quick else "full",
                  started_at=t_start)
    print_table(rows)
    return rows


def plot(results_root: str | Path | None = None, out_dir: str | Path = "paper/figures") -> Path:
    """``replay.png``: three panels over the same cells (one row each): TTFT p50 and p99, goodput,
    and block hit rate split by the tier that served it."""
    import numpy as np

    from experiments.plotstyle import BASELINE as BASE_COLOUR
    from experiments.plotstyle import OURS, PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_raw

    cells = read_raw(NAME, "raw", results_root)
    labels = [f"{r} / {p}" + (" / small tiers" if t == "small" else "")
              for r, p, t in zip(cells["router"], cells["policy"], cells["tiers"])]
    y = np.arange(len(cells))[::-1]
    fig, axes = figure(10.0, 3.6, 1, 3, sharey=True)
    a = axes[0]
    a.barh(y + 0.2, cells["ttft_p50_s"], 0.4, label="p50", color=OURS)
    a.barh(y - 0.2, cells["ttft_p99_s"], 0.4, label="p99", color=BASE_COLOUR)
    a.set_yticks(y)
    a.set_yticklabels(labels)
    style_axes(a, xlabel="seconds", title="TTFT (lower is better)")
    legend(a, loc="lower right")
    axes[1].barh(y, cells["goodput_rps"], 0.6, color=PALETTE[2])
    style_axes(axes[1], xlabel=f"requests/s with TTFT <= {float(cells['slo_ttft_s'].iloc[0]):g} s",
               title="Goodput (higher is better)")
    left = np.zeros(len(cells))
    for t, colour in zip(["gpu", "dram", "ssd", "peer"], [PALETTE[0], PALETTE[5], PALETTE[1], PALETTE[3]]):
        v = cells[f"block_hit_rate_{t}"].to_numpy(float)
        axes[2].barh(y, v, 0.6, left=left, label=t.upper(), color=colour)
        left += v
    style_axes(axes[2], xlabel="share of prompt blocks", title="Block hits by tier (higher is better)")
    legend(axes[2], loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4)
    fig.suptitle(f"Trace replay: {int(cells['requests'].iloc[0]):,} requests on {int(cells['engines'].iloc[0])} "
                 "engines (engine compute is the engine model, a stand-in)", fontsize=10)
    return save(fig, Path(out_dir) / "replay.png")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="replay the first 600 requests (smoke test)")
    ap.add_argument("--results-root", default=None, help="results root (default ./results)")
    ap.add_argument("--trace", default=None, help="trace path (default: the shared conversation trace)")
    args = ap.parse_args(argv)
    try:
        run(quick=args.quick, results_root=args.results_root, trace=args.trace)
    except TraceError as exc:  # a missing or malformed trace: one line, nothing written
        ap.error(f"--trace: {exc}")


if __name__ == "__main__":
    main()
