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
summary) and ``paper/figures/replay.png`` (``plot`` reads only ``raw.csv``).
Quick mode replays the first ``QUICK_LIMIT`` requests; full mode the whole trace.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from quillcache.harness import ReplayConfig, replay
from quillcache.results import SummaryRow, print_table, results_dir, write_raw, write_summary
from quillcache.traces.loader import default_trace_path, load_trace

NAME = "replay"
ROUTERS = ["dynamo", "round_robin", "least_loaded", "prefix_affinity"]
BASELINE = "round_robin"
METRICS = [("ttft_p50_s", "s"), ("ttft_p99_s", "s"), ("goodput_rps", "req/s"), ("slo_attainment", "fraction"),
           ("block_hit_rate", "fraction"), ("token_hit_rate", "fraction")]
QUICK_LIMIT = 600
# Host tiers small enough that the pool must evict (the GPU tier is the engine model's).
SMALL_TIERS = {"dram_capacity_blocks": 512, "ssd_capacity_blocks": 1024}


def _cells() -> list[tuple[str, str, str]]:
    """(router, policy, tiers) for every replay of the study."""
    return ([(r, "lru", "default") for r in ROUTERS] + [("dynamo", "quillhd", "default")]
            + [("dynamo", p, "small") for p in ("lru", "quillhd")])


def run(quick: bool = False, results_root: str | None = None, trace: str | None = None) -> list[SummaryRow]:
    reqs = load_trace(trace or default_trace_path(), limit=QUICK_LIMIT if quick else None)
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
    by = {(d["router"], d["policy"]): d for d in raw if d["tiers"] == "default"}
    mode = f"{'quick' if quick else 'full'}: {len(reqs)} requests"
    rows: list[SummaryRow] = []
    for router in ROUTERS:
        d, b = by[(router, "lru")], by[(BASELINE, "lru")]
        for m, unit in METRICS:
            rows.append(SummaryRow(metric=m, subject=f"{router}/lru", value=float(d[m]), unit=unit,
                                   baseline=f"{BASELINE}/lru", baseline_value=float(b[m]), n=1,
                                   notes=f"{mode}; deterministic replay (seed 0); wall {d['wall_s']:.1f} s"))
    q, lru = by[("dynamo", "quillhd")], by[("dynamo", "lru")]
    for m, unit in METRICS:
        rows.append(SummaryRow(metric=m, subject="dynamo/quillhd", value=float(q[m]), unit=unit,
                               baseline="dynamo/lru", baseline_value=float(lru[m]), n=1,
                               notes=f"{mode}; deterministic replay (seed 0); wall {q['wall_s']:.1f} s"))
    small = {d["policy"]: d for d in raw if d["tiers"] == "small"}
    for m, unit in METRICS:
        rows.append(SummaryRow(metric=f"{m}@small_tiers", subject="dynamo/quillhd", value=float(small["quillhd"][m]),
                               unit=unit, baseline="dynamo/lru", baseline_value=float(small["lru"][m]), n=1,
                               notes=f"{mode}; {SMALL_TIERS}; wall {small['quillhd']['wall_s']:.1f} s"))
    write_summary(NAME, rows, root=results_root)
    plot(results_root, results_dir(NAME, results_root) if results_root else Path("paper/figures"))
    print_table(rows)
    return rows


def plot(results_root: str | Path | None = None, out_dir: str | Path = "paper/figures") -> Path:
    """``replay.png`` from ``results/replay/raw.csv``: per cell TTFT p50/p99, goodput, hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results_dir(NAME, results_root) / "raw.csv", newline="") as fh:
        cells = list(csv.DictReader(fh))
    labels = [f"{c['router']}\n{c['policy']}" + ("\nsmall tiers" if c.get("tiers") == "small" else "") for c in cells]
    x = range(len(cells))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    a = axes[0]
    a.bar([i - 0.2 for i in x], [float(c["ttft_p50_s"]) for c in cells], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [float(c["ttft_p99_s"]) for c in cells], 0.4, label="p99")
    a.set_ylabel("TTFT (s)")
    a.legend(fontsize=8)
    axes[1].bar(x, [float(c["goodput_rps"]) for c in cells], color="tab:green")
    axes[1].set_ylabel(f"goodput (req/s, TTFT <= {float(cells[0]['slo_ttft_s']):g} s)")
    tiers = ["gpu", "dram", "ssd", "peer"]
    bottom = [0.0] * len(cells)
    for t in tiers:
        v = [float(c[f"block_hit_rate_{t}"]) for c in cells]
        axes[2].bar(x, v, bottom=bottom, label=t.upper())
        bottom = [b + w for b, w in zip(bottom, v)]
    axes[2].set_ylabel("block hit rate by tier")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7)
    fig.suptitle(f"conversation-trace replay: {cells[0]['requests']} requests, {cells[0]['engines']} engines")
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "replay.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="replay the first 600 requests (smoke test)")
    ap.add_argument("--results-root", default=None, help="results root (default ./results)")
    ap.add_argument("--trace", default=None, help="trace path (default: the shared conversation trace)")
    args = ap.parse_args(argv)
    run(quick=args.quick, results_root=args.results_root, trace=args.trace)


if __name__ == "__main__":
    main()
