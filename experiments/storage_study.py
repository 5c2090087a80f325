"""Storage study: which index fits residency — ART vs RocksDB vs flat map vs SortedDict.

For each entry count (100k and 1M live replicas by default) the residency churn of the Mooncake
conversation trace (``quillcache.traces.churn``) is generated once, then every backend runs
in its OWN subprocess (clean RSS and ``/proc/self/io`` accounting) and measures, in one run:

- build: the churn applied batch by batch (one batch per request), then ``flush()``; ops/s;
- write amplification: bytes the OS wrote for this process (``/proc/self/io`` write_bytes,
  build + flush) / logical bytes (key + value bytes the index was asked to write); the bytes
  written by ``close()`` (checkpoints) are reported separately and in a total; for RocksDB also
  from its own statistics (WAL + flush + compaction bytes);
- point lookup of one live block hash from Python: ``locate_raw`` (every replica's packed record,
  the index's own cost) p50/p99 over many calls, and ``locate`` (decoded entry objects) p50;
- batched ``locate_arrays`` over 10k hashes (columnar result), ns per hash: ``BATCH_LOCATE_REPS``
  calls, each on a fresh random batch (drawn and checked outside the timer); median with p10/p90;
- prefix scan (``scan_prefix``) of ``b"B" + k`` leading hash bytes, k chosen so a scan returns
  ~1–50 entries: p50/p99 (the flat map's is O(N), so it is sampled less);
- recovery: ``close()`` time, then reopen → first correct ``locate`` answer (median of 5 reopens,
  3 for the snapshot baselines, with p10/p90; the ART verifies checkpoint chunks lazily by
  default, and is also timed verifying every chunk at open);
- resident memory growth (RSS after build − RSS before open).

Build rate, write amplification, ``close()`` time and memory growth come from the one build of
each cell (``n`` = 1, no spread); point lookups and scans are percentiles of their calls (``n`` =
the calls); reopen and batched-lookup rows are medians of their repetitions (``n``, p10, p90).

Writes ``results/storage/summary.csv`` (one row per backend, metric and entry count; ratios against
RocksDB, and the flat map's scan against ART's), ``results/storage/cells.csv`` (every raw number);
``plot`` draws ``paper/figures/storage.png`` from them.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from quillcache.index import INDEX_BACKENDS, open_index
from quillcache.results import SummaryRow, spread, write_raw, write_summary

STUDY = "storage"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
FULL_ENTRIES = (100_000, 1_000_000)
QUICK_ENTRIES = (10_000,)
BATCH_LOCATE_REPS = 5
# cell fields that are medians of repeated measurements -> the field holding their samples
SAMPLED = {"recovery_s": "recovery_s_samples", "recovery_eager_s": "recovery_eager_s_samples",
           "batch_locate_ns_per_hash": "batch_locate_ns_samples"}


def _io_write_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no write_bytes line")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE_BYTES


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    a = np.asarray(samples_ns, dtype=np.float64)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _rocksdb_stat_bytes(ix) -> dict[str, int]:
    stats = ix.ticker_counts() if hasattr(ix, "ticker_counts") else {}
    return {k: stats.get(k, 0) for k in ("rocksdb.wal.bytes", "rocksdb.flush.write.bytes", "rocksdb.compact.write.bytes")}


def run_cell(kind: str, workload_path: str, db_dir: str, num_point: int, num_scan: int, seed: int) -> dict:
    """Measure one backend on one workload; runs in a fresh process."""
    with open(workload_path, "rb") as fh:
        w = pickle.load(fh)
    rng = random.Random(seed)
    live = list(w.live.values())
    hashes = sorted({e.block_hash for e in live})
    expect: dict[int, list] = {}
    for e in live:
        expect.setdefault(e.block_hash, []).append(e)
    n_live = len(live)
    hash_bytes = max(1, round(math.log(max(2, n_live) / 16, 256)))

    rss0 = _rss_bytes()
    io0 = _io_write_bytes()
    t0 = time.perf_counter()
    ix = open_index(kind, db_dir)
    for b in w.batches:
        if b.puts:
            ix.put(b.puts)
        if b.removes:
            ix.remove(b.removes)
    ix.flush()
    build_s = time.perf_counter() - t0
    io_build = _io_write_bytes() - io0
    rss_growth = _rss_bytes() - rss0
    logical = ix.logical_bytes_written
    rocks = _rocksdb_stat_bytes(ix) if kind == "rocksdb" else {}

    # The workload's millions of Python objects stay alive for the checks below; move them out of
    # the collector's reach so a collection never lands inside a timed call (same for every backend).
    gc.collect()
    gc.freeze()

    # correctness spot check before timing
    for h in rng.sample(hashes, min(200, len(hashes))):
        got = ix.locate([h])[0]
        assert sorted(got, key=lambda e: (e.node, e.tier, e.identity)) == sorted(
            expect[h], key=lambda e: (e.node, e.tier, e.identity)
        ), f"{kind}: wrong locate answer for {h:#x}"

    point, point_obj = [], []
    for h in rng.choices(hashes, k=num_point):
        t = time.perf_counter_ns()
        ix.locate_raw(h)
        point.append(time.perf_counter_ns() - t)
    for h in rng.choices(hashes, k=max(1, num_point // 4)):
        t = time.perf_counter_ns()
        ix.locate([h])
        point_obj.append(time.perf_counter_ns() - t)
    scan, scan_sizes = [], []
    n_scan = num_scan if kind != "flat" else min(num_scan, 20)
    for h in rng.choices(hashes, k=n_scan):
        prefix = b"B" + h.to_bytes(8, "big")[:hash_bytes]
        t = time.perf_counter_ns()
        rows = ix.scan_prefix(prefix)
        scan.append(time.perf_counter_ns() - t)
        scan_sizes.append(len(rows))
    batch_ns = []
    for _ in range(BATCH_LOCATE_REPS):
        batch_hashes = rng.choices(hashes, k=min(10_000, len(hashes)))
        batch_arr = np.array(batch_hashes, dtype=np.uint64)
        t = time.perf_counter_ns()
        res = ix.locate_arrays(batch_arr)
        batch_ns.append((time.perf_counter_ns() - t) / len(batch_hashes))
        assert int(res.offsets[-1]) == sum(len(expect[h]) for h in batch_hashes), f"{kind}: batched locate disagrees"

    io1 = _io_write_bytes()
    t = time.perf_counter()
    ix.close()
    close_s = time.perf_counter() - t
    io_close = _io_write_bytes() - io1

    probe = hashes[len(hashes) // 2]
    reps = 5 if kind not in ("flat", "sorted") else 3

    def reopen_time(**opts) -> float:
        t = time.perf_counter()
        ix2 = open_index(kind, db_dir, **opts)
        got = ix2.locate([probe])[0]
        elapsed = time.perf_counter() - t
        assert len(got) == len(expect[probe]), f"{kind}: wrong answer after reopen"
        ix2.close()
        return elapsed

    recovery = [reopen_time() for _ in range(reps)]
    eager: list[float] = []
    if kind == "art":  # the same reopen verifying every checkpoint chunk up front (default: lazily)
        eager = [reopen_time(verify_checkpoint="eager") for _ in range(reps)]

    p50, p99 = _percentiles(point)
    o50, o99 = _percentiles(point_obj)
    s50, s99 = _percentiles(scan)
    ops = w.num_puts + w.num_removes
    return {
        "kind": kind,
        "entries": n_live,
        "ops": ops,
        "build_s": build_s,
        "insert_ops_per_s": ops / build_s,
        "logical_bytes": logical,
        "io_build_bytes": io_build,
        "io_close_bytes": io_close,
        "wa_build": io_build / logical,
        "wa_total": (io_build + io_close) / logical,
        "rocksdb_stat_bytes": sum(rocks.values()) if rocks else float("nan"),
        "rocksdb_stats": rocks,
        "point_p50_ns": p50,
        "point_p99_ns": p99,
        "point_n": len(point),
        "locate_obj_p50_ns": o50,
        "locate_obj_p99_ns": o99,
        "scan_p50_ns": s50,
        "scan_p99_ns": s99,
        "scan_n": len(scan),
        "scan_mean_rows": float(np.mean(scan_sizes)),
        "scan_prefix_hash_bytes": hash_bytes,
        "batch_locate_ns_per_hash": float(np.median(batch_ns)),
        "close_s": close_s,
        "recovery_s": float(np.median(recovery)),
        "recovery_eager_s": float(np.median(eager)) if eager else float("nan"),
        "rss_growth_bytes": rss_growth,
        "recovery_s_samples": recovery,
        "recovery_eager_s_samples": eager,
        "batch_locate_ns_samples": batch_ns,
    }


def _summary(cells: list[dict]) -> list[SummaryRow]:
    rows: list[SummaryRow] = []
    by = {(c["entries_target"], c["kind"]): c for c in cells}
    metrics = [
        ("point_locate_p50", "point_p50_ns", "ns", "point_p50_ns"),
        ("point_locate_p99", "point_p99_ns", "ns", "point_p99_ns"),
        ("locate_objects_p50", "locate_obj_p50_ns", "ns", "locate_obj_p50_ns"),
        ("prefix_scan_p50", "scan_p50_ns", "ns", "scan_p50_ns"),
        ("prefix_scan_p99", "scan_p99_ns", "ns", "scan_p99_ns"),
        ("insert_rate", "insert_ops_per_s", "ops/s", "insert_ops_per_s"),
        ("write_amplification_build", "wa_build", "x", "wa_build"),
        ("write_amplification_total", "wa_total", "x", "wa_total"),
        ("recovery_reopen_to_first_answer", "recovery_s", "s", "recovery_s"),
        ("recovery_reopen_eager_verify", "recovery_eager_s", "s", "recovery_s"),
        ("close", "close_s", "s", "close_s"),
        ("rss_growth", "rss_growth_bytes", "bytes", "rss_growth_bytes"),
        ("batch_locate", "batch_locate_ns_per_hash", "ns/hash", "batch_locate_ns_per_hash"),
    ]
    for (target, kind), c in sorted(by.items()):
        base = by.get((target, "rocksdb"))
        base_kind = "rocksdb"
        for metric, field, unit, base_field in metrics:
            if isinstance(c[field], float) and math.isnan(c[field]):
                continue
            bv = base[base_field] if base is not None and kind != base_kind else math.nan
            notes = f"entries={c['entries']} ops={c['ops']}"
            if field.startswith("scan"):
                notes += f" mean_rows={c['scan_mean_rows']:.1f} prefix=B+{c['scan_prefix_hash_bytes']}B n={c['scan_n']}"
            if field.startswith("point"):
                notes += f" n={c['point_n']}"
            common = dict(metric=metric, params={"entries": target}, subject=kind, unit=unit,
                          baseline=base_kind if not math.isnan(bv) else "", baseline_value=bv)
            if field in SAMPLED:  # a median of repetitions: its samples give n and the spread
                samples = c[SAMPLED[field]]
                rows.append(SummaryRow.from_spread(spread(samples), n=len(samples),
                                                   notes=notes + f"; median of {len(samples)} repetitions", **common))
                continue
            n = {"point": c["point_n"], "scan_": c["scan_n"], "locat": max(1, c["point_n"] // 4)}.get(field[:5], 1)
            if n == 1:
                notes += "; one build of this cell (n=1)"
            rows.append(SummaryRow(value=c[field], n=n, notes=notes, **common))
        if kind == "rocksdb":
            rows.append(
                SummaryRow(
                    metric="write_amplification_rocksdb_stats",
                    params={"entries": target},
                    subject="rocksdb",
                    value=c["rocksdb_stat_bytes"] / c["logical_bytes"],
                    unit="x",
                    notes="(WAL + flush + compaction bytes from RocksDB statistics) / logical bytes: "
                    + json.dumps(c["rocksdb_stats"]),
                )
            )
        for subject, base_kind, note in (("flat", "art", "O(N) flat-map scan vs ART"),
                                         ("art", "sorted", "ART vs SortedDict.irange")):
            other = by.get((target, base_kind))
            if kind == subject and other is not None:
                rows.append(
                    SummaryRow(
                        metric="prefix_scan_p50",
                        params={"entries": target},
                        subject=subject,
                        value=c["scan_p50_ns"],
                        unit="ns",
                        baseline=base_kind,
                        baseline_value=other["scan_p50_ns"],
                        n=c["scan_n"],
                        notes=note,
                    )
                )
    return rows


def run(quick: bool = False, results_root: str | None = None, *, trace: str | None = None,
        entries: list[int] | None = None, backends: list[str] | None = None, point_samples: int = 20000,
        scan_samples: int = 5000, seed: int = 0, workdir: str | None = None) -> list[SummaryRow]:
    """Run every backend at every entry count (quick: 10k entries, few samples) and write the results."""
    from quillcache.traces.churn import residency_churn
    from quillcache.traces.loader import default_trace_path, load_trace

    t_start = time.monotonic()
    targets = list(entries or FULL_ENTRIES)
    if quick:
        targets, point_samples, scan_samples = list(QUICK_ENTRIES), 500, 200
    kinds = list(backends or sorted(INDEX_BACKENDS))
    unknown = [k for k in kinds if k not in INDEX_BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backends {unknown}; registered: {sorted(INDEX_BACKENDS)}")
    trace_reqs = load_trace(trace or default_trace_path())
    work = Path(workdir or tempfile.mkdtemp(prefix="qc-storage-"))
    work.mkdir(parents=True, exist_ok=True)
    cells = []
    try:
        for target in targets:
            t = time.perf_counter()
            w = residency_churn(trace_reqs, target, seed=seed)
            wpath = work / f"workload-{target}.pkl"
            with open(wpath, "wb") as fh:
                pickle.dump(w, fh, protocol=pickle.HIGHEST_PROTOCOL)
            print(f"[storage] {target}: {len(w.live)} live, {w.num_puts} puts, {w.num_removes} removes "
                  f"({time.perf_counter() - t:.1f} s to generate)", flush=True)
            del w
            for kind in kinds:
                dbdir = work / f"{kind}-{target}"
                shutil.rmtree(dbdir, ignore_errors=True)
                cmd = [sys.executable, "-m", "experiments.storage_study", "--cell", kind, str(wpath), str(dbdir),
                       "--point-samples", str(point_samples), "--scan-samples", str(scan_samples),
                       "--seed", str(seed)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"[storage] cell {kind}@{target} failed:\n{out.stderr[-4000:]}")
                cell = json.loads(out.stdout.strip().splitlines()[-1])
                cell["entries_target"] = target
                cells.append(cell)
                print(f"[storage] {kind:8s}@{target}: point p50 {cell['point_p50_ns'] / 1e3:.2f} µs, "
                      f"scan p50 {cell['scan_p50_ns'] / 1e3:.2f} µs ({cell['scan_mean_rows']:.1f} rows), "
                      f"insert {cell['insert_ops_per_s'] / 1e3:.0f} k ops/s, WA {cell['wa_build']:.2f}/{cell['wa_total']:.2f}, "
                      f"recovery {cell['recovery_s'] * 1e3:.1f} ms, RSS +{cell['rss_growth_bytes'] / 2**20:.0f} MiB", flush=True)
                shutil.rmtree(dbdir, ignore_errors=True)
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    fields = [k for k in cells[0] if k != "rocksdb_stats" and k not in SAMPLED.values()]
    write_raw(STUDY, "cells.csv", fields, [[c[k] for k in fields] for c in cells], root=results_root)
    write_raw(STUDY, "samples.csv", ["kind", "entries", "field", "rep", "value"],
              [[c["kind"], c["entries_target"], f, i, v] for c in cells for f, key in SAMPLED.items()
               for i, v in enumerate(c[key])], root=results_root)
    rows = _summary(cells)
    path = write_summary(STUDY, rows, root=results_root, profile="quick" if quick else "full", started_at=t_start)
    print(f"[storage] wrote {path}")
    return rows


# ---------------------------------------------------------------- figure

# (metric, panel title, unit label, higher is better); a panel is log-scaled when its values span
# more than two decades.
PANELS = [
    ("point_locate_p50", "Point lookup p50", "ns per lookup", False),
    ("prefix_scan_p50", "Prefix scan p50", "ns per scan", False),
    ("insert_rate", "Build rate", "operations/s", True),
    ("recovery_reopen_to_first_answer", "Reopen to first answer", "s", False),
    ("write_amplification_total", "Write amplification", "bytes written / logical", False),
    ("rss_growth", "Memory growth", "MiB resident", False),
]
BACKEND_ORDER = ["art", "rocksdb", "sorted", "flat"]


def plot(results_root: str | None = None, out_dir: str | Path = "paper/figures") -> Path:
    """Six panels, one question each; in every panel each backend's bar per entry count (ART, ours,
    in the house colour, RocksDB as the baseline colour)."""
    from experiments.plotstyle import BASELINE, GREY, OURS, PALETTE, figure, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(STUDY, results_root)
    df = df.drop_duplicates(subset=["metric", "subject", "entries"])
    targets = sorted(int(e) for e in df["entries"].dropna().unique())
    kinds = [k for k in BACKEND_ORDER if k in set(df["subject"])]
    colour = {"art": OURS, "rocksdb": BASELINE, "sorted": PALETTE[2], "flat": GREY}
    fig, axes = figure(10.0, 6.0, 2, 3)
    w = 0.8 / max(1, len(kinds))
    for ax, (metric, title, unit, higher) in zip(axes.flat, PANELS):
        part = df[df["metric"] == metric].set_index(["subject", "entries"])["value"]
        scale = 1 / 2**20 if metric == "rss_growth" else 1.0
        values = [float(v) * scale for v in part if v > 0]
        log = bool(values) and max(values) / min(values) > 100
        for i, kind in enumerate(kinds):
            ys = [float(part.get((kind, t), np.nan)) * scale for t in targets]
            ax.bar(np.arange(len(targets)) + (i - (len(kinds) - 1) / 2) * w, ys, w,
                   label=kind + (" (ours)" if kind == "art" else " (baseline)" if kind == "rocksdb" else ""),
                   color=colour[kind])
        ax.set_xticks(np.arange(len(targets)))
        ax.set_xticklabels([f"{t:,} entries" for t in targets])
        if log:
            ax.set_yscale("log")
        style_axes(ax, ylabel=unit + (", log scale" if log else ""),
                   title=f"{title} ({'higher' if higher else 'lower'} is better)")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=len(kinds), frameon=False, fontsize=9)
    return save(fig, Path(out_dir) / "storage.png")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None,
                    help="Mooncake-format trace (default: quillcache.traces.loader.default_trace_path(), "
                         "i.e. $QUILLCACHE_TRACE or ../shared/traces/conversation_trace.jsonl)")
    ap.add_argument("--entries", default=",".join(map(str, FULL_ENTRIES)), help="comma-separated live-entry targets")
    ap.add_argument("--backends", default=",".join(sorted(INDEX_BACKENDS)))
    ap.add_argument("--point-samples", type=int, default=20000)
    ap.add_argument("--scan-samples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-root", default=None)
    ap.add_argument("--workdir", default=None, help="where the indexes are built (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="10k entries, few samples (smoke test)")
    ap.add_argument("--cell", nargs=3, metavar=("KIND", "WORKLOAD", "DBDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        entries = [int(x) for x in args.entries.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--entries {args.entries!r}: comma-separated whole numbers of entries (e.g. 10000,100000)")
    if not entries or min(entries) < 1:
        ap.error(f"--entries {args.entries!r}: at least one target, each >= 1")

    if args.cell:
        kind, wpath, dbdir = args.cell
        print(json.dumps(run_cell(kind, wpath, dbdir, args.point_samples, args.scan_samples, args.seed)))
        return
    run(args.quick, args.results_root, trace=args.trace,
        entries=entries,
        backends=[k.strip() for k in args.backends.split(",") if k.strip()],
        point_samples=args.point_samples, scan_samples=args.scan_samples, seed=args.seed, workdir=args.workdir)


if __name__ == "__main__":
    main()
