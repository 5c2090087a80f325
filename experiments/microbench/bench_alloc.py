"""Offset allocator: compiled ``OffsetAllocator`` vs the plain-Python ``PyOffsetAllocator``.

Same run, same parameters, same seeds, interleaved repetitions. REFERENCE §6's figures for the
C++ OffsetAllocator (a random free+alloc pair, and an operation in a burst) are written to
``anchors.csv`` (``anchors()``: labelled anchors, never same-run baselines) and shown in the report.
Both allocators take identical decisions, so each repetition does the same work on both.

Measurements (all medians over repetitions, p10/p90 in notes):
- ``churn_pair_ns``: steady state. Fill ``LIVE`` random allocations, run ``warmup_pairs``
  untimed free+allocate pairs (the same on both), then time ``churn(pairs, ...)`` (the loop runs
  inside the allocator: SplitMix64 picks a live allocation to free and a size to allocate; the
  reference times fewer pairs, the figure is per pair). Acceptance: <= 200 ns/pair and >= 50x
  the reference (``churn_speedup``: the median of the per-repetition ratios).
- ``allocate_call_ns`` / ``free_call_ns``: one Python call each, timed one by one with
  ``time.perf_counter_ns`` around the call (timer overhead included, nothing subtracted), in the
  same steady state; median and p99 of every call of a repetition, then the median over
  repetitions. GC stays enabled (it is part of a real caller's cost). Acceptance: median <= 1 us.
- ``burst_alloc_ns`` / ``burst_free_ns``: ``allocate_batch`` of ``LIVE`` sizes into an empty
  allocator, then ``free_batch`` of all of them, per item.
"""

from __future__ import annotations

import time

import numpy as np

from experiments.microbench import bench_main
from quillcache.alloc import OffsetAllocator, PyOffsetAllocator
from quillcache.results import Anchor, SummaryRow, print_table, spread, write_raw, write_summary

NAME = "microbench_alloc"
ALIGNMENT = 4096  # page-aligned KV blocks
MIN_SIZE = 4 << 10  # 4 KiB .. 2 MiB: one per-layer page up to a Llama-3-8B 16-token block
MAX_SIZE = 2 << 20
CAPACITY = 128 << 30  # 2**25 units; LIVE blocks of ~1 MiB fill ~40%
LIVE = 50_000
MAX_ALLOCS = 2 * LIVE + 1024  # regions <= live + 1, so churn can never run out of nodes
RNG_SEED = 20240611

FULL = dict(reps=9, fast_pairs=2_000_000, ref_pairs=50_000, warmup_pairs=100_000, fast_calls=50_000, ref_calls=5_000)
QUICK = dict(reps=3, fast_pairs=100_000, ref_pairs=3_000, warmup_pairs=2_000, fast_calls=5_000, ref_calls=1_000)

FAST, REF = "cython OffsetAllocator", "python PyOffsetAllocator"
REFERENCE_6 = "REFERENCE §6 (C++ OffsetAllocator, measured on this machine kind in an earlier session)"
REFERENCE_6_ROW = "OffsetAllocator (C++): random free+alloc pair / burst | 80–88 ns / 15–17 ns"


def anchors() -> list[Anchor]:
    """REFERENCE §6's C++ OffsetAllocator figures, each a range kept as its two ends (``range_end``
    low and high), in the units it gives: comparison points, never same-run baselines."""
    figures = (("churn_pair_ns", "random free+alloc pair", 80.0, 88.0), ("burst_ns", "burst", 15.0, 17.0))
    return [Anchor(metric=metric, subject="C++ OffsetAllocator", value=value, unit="ns", source=REFERENCE_6,
                   params={"range_end": end}, notes=f"{what}; REFERENCE §6 row: {REFERENCE_6_ROW}")
            for metric, what, low, high in figures for end, value in (("low", low), ("high", high))]


def _filled(cls, sizes: np.ndarray, warmup_pairs: int, seed: int):
    a = cls(CAPACITY, MAX_ALLOCS, alignment=ALIGNMENT)
    a.allocate_batch(sizes)
    a.churn(warmup_pairs, MIN_SIZE, MAX_SIZE, seed)
    return a


def _call_latencies(a, n_calls: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Alternately free one random live allocation and allocate a random size, timing each call."""
    live = [x.handle for x in a.live_allocations()]
    picks = rng.integers(0, len(live), n_calls).tolist()
    sizes = rng.integers(MIN_SIZE, MAX_SIZE, n_calls, endpoint=True).tolist()
    free_ns, alloc_ns = [], []
    pc = time.perf_counter_ns
    free, allocate = a.free, a.allocate
    for j, size in zip(picks, sizes):
        h = live[j]
        t0 = pc()
        free(h)
        t1 = pc()
        x = allocate(size)
        t2 = pc()
        live[j] = x.handle
        free_ns.append(t1 - t0)
        alloc_ns.append(t2 - t1)
    return free_ns, alloc_ns


def _p(samples: list[int], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    t_start = time.monotonic()
    cfg = QUICK if quick else FULL
    raw: list[tuple] = []  # (metric, subject, rep, value, unit)
    for rep in range(cfg["reps"]):
        rng = np.random.default_rng(RNG_SEED + rep)
        sizes = rng.integers(MIN_SIZE, MAX_SIZE, LIVE, endpoint=True)
        seed = RNG_SEED * 1000 + rep
        per_pair = {}
        for cls, subject, pairs in ((OffsetAllocator, FAST, cfg["fast_pairs"]), (PyOffsetAllocator, REF, cfg["ref_pairs"])):
            # burst: allocate_batch into an empty allocator, then free_batch of everything
            a = cls(CAPACITY, MAX_ALLOCS, alignment=ALIGNMENT)
            t0 = time.perf_counter_ns()
            _, handles = a.allocate_batch(sizes)
            t1 = time.perf_counter_ns()
            a.free_batch(handles)
            t2 = time.perf_counter_ns()
            raw.append(("burst_alloc_ns", subject, rep, (t1 - t0) / LIVE, "ns/alloc"))
            raw.append(("burst_free_ns", subject, rep, (t2 - t1) / LIVE, "ns/free"))
            # steady state: churn inside the allocator
            a = _filled(cls, sizes, cfg["warmup_pairs"], seed)
            per_pair[subject] = a.churn(pairs, MIN_SIZE, MAX_SIZE, seed + 1) / pairs
            raw.append(("churn_pair_ns", subject, rep, per_pair[subject], "ns/pair"))
            rep_live = a.storage_report()
            assert rep_live.num_live_allocations == LIVE, rep_live
            # single calls from Python, same steady state
            n_calls = cfg["fast_calls"] if cls is OffsetAllocator else cfg["ref_calls"]
            free_ns, alloc_ns = _call_latencies(a, n_calls, np.random.default_rng(seed + 2))
            for metric, samples in (("allocate_call_ns", alloc_ns), ("free_call_ns", free_ns)):
                raw.append((metric + "_median", subject, rep, _p(samples, 50), "ns/call"))
                raw.append((metric + "_p99", subject, rep, _p(samples, 99), "ns/call"))
        raw.append(("churn_speedup", "cython/python same rep", rep, per_pair[REF] / per_pair[FAST], "x"))

    write_raw(NAME, "raw.csv", ["metric", "subject", "rep", "value", "unit"], raw, root=results_root)
    rows = _summarise(raw, cfg)
    write_summary(NAME, rows, root=results_root, profile="quick" if quick else "full", anchors=anchors(),
                  started_at=t_start)
    print_table(rows)
    return rows


ACCEPT = {"churn_pair_ns": ("<=", 200.0), "churn_speedup": (">=", 50.0),
          "allocate_call_ns_median": ("<=", 1000.0), "free_call_ns_median": ("<=", 1000.0)}


def _summarise(raw: list[tuple], cfg: dict) -> list[SummaryRow]:
    rows = []
    metrics = list(dict.fromkeys(r[0] for r in raw))
    mode = f"LIVE={LIVE}, sizes {MIN_SIZE}..{MAX_SIZE} B, alignment {ALIGNMENT}, reps={cfg['reps']}"
    for metric in metrics:
        subjects = list(dict.fromkeys(r[1] for r in raw if r[0] == metric))
        stats = {s: spread([r[3] for r in raw if r[0] == metric and r[1] == s]) for s in subjects}
        unit = next(r[4] for r in raw if r[0] == metric)
        for s in subjects:
            if s == REF and FAST in subjects:
                continue  # the reference appears as the baseline of the compiled row
            st = stats[s]
            note = mode
            if metric in ACCEPT:
                op, bound = ACCEPT[metric]
                ok = st["median"] <= bound if op == "<=" else st["median"] >= bound
                note += f"; acceptance {op} {bound:g}: {'PASS' if ok else 'FAIL'}"
            base = stats.get(REF) if s == FAST else None
            if base is not None:
                note += f"; speedup {base['median'] / st['median']:.1f}x"
            rows.append(SummaryRow.from_spread(st, metric=metric, subject=s, unit=unit,
                                   baseline=REF if base is not None else "",
                                   baseline_value=base["median"] if base is not None else float("nan"),
                                   n=cfg["reps"], notes=note))
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """The speed-up over the same-run baseline of every row that has one (log scale)."""
    from pathlib import Path

    from experiments.plotstyle import speedup_chart
    from quillcache.results import read_summary

    name = NAME
    return speedup_chart(read_summary(name, results_root), "Offset allocator vs its plain-Python reference", Path(out_dir) / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
