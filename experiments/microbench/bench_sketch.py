"""Count-min sketch throughput against exact counting, measured in the same run.

Stream: ``N_KEYS`` Zipf(``ZIPF_A``) ranks pushed through splitmix64 so they look like block
hashes. Sketch: eps=0.001, delta=0.01 (2719 x 5 uint32 counters, 54 KiB).

Subjects (each repeated ``REPS`` times, median quoted, p10/p90 in the notes):
- ``CountMinSketch.add`` batched, conservative and standard update; ``estimate`` batched;
  conservative with heavy-hitter tracking (top_k=16) and with TinyLFU aging.
- Baselines: ``collections.Counter().update(keys)`` over the numpy array as given, and over a
  Python list prepared outside the timer (the fastest Counter form); ``estimate`` is compared
  with dict lookups ``list(map(counter.__getitem__, list))``.
- Competitor (full mode only): the same algorithm and hashing jitted with Numba.
Every sketch rate is reported against BOTH Counter forms. Timings are wall-clock; the CPU time
of the measuring thread is recorded in the raw CSV because this machine is shared.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from typing import Callable

import numpy as np

from experiments.microbench import bench_main
from quillcache._mix import splitmix64_array
from quillcache.results import SummaryRow, print_table, spread, write_raw, write_summary
from quillcache.sketch.countmin import CountMinSketch

NAME = "microbench_sketch"
EPS, DELTA = 0.001, 0.01
ZIPF_A = 1.2
SEED = 20240611
FULL = dict(n_keys=5_000_000, reps=7, numba=True)
QUICK = dict(n_keys=200_000, reps=3, numba=False)
TOP_K = 16
ACCEPT_KEYS_S, ACCEPT_RATIO = 20e6, 30.0  # the brief's bar for conservative batched update
AGING_WINDOW = 100_000


def block_hash_stream(n_keys: int, a: float, seed: int) -> np.ndarray:
    """Zipf ranks through splitmix64 (vectorised; uint64 arithmetic wraps)."""
    return splitmix64_array(np.random.default_rng(seed).zipf(a, n_keys).astype(np.uint64))


Subject = tuple[str, Callable[[], object], "Callable[[], object] | None"]


def _interleaved(subjects: list[Subject], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Time every subject once per round, round after round, so that slow drifts of a shared
    machine hit all subjects alike. Returns (wall_s, thread_cpu_s) per round; ``setup`` (second
    callable) runs untimed before each measurement."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in subjects}
    for _ in range(rounds):
        for name, fn, setup in subjects:
            if setup is not None:
                setup()
            gc.collect()
            gc.disable()
            try:
                w0, c0 = time.perf_counter(), time.thread_time()
                fn()
                out[name].append((time.perf_counter() - w0, time.thread_time() - c0))
            finally:
                gc.enable()
    return out


def _numba_kernels():
    """The same algorithm (splitmix64, double hashing, multiply-shift) jitted with Numba."""
    import numba

    from quillcache._mix import splitmix64_nb as _mix

    @numba.njit(cache=False, nogil=True)
    def add(table, keys, skey, conservative):
        depth, width = table.shape
        w = np.uint64(width)
        m32 = np.uint64(0xFFFFFFFF)
        cols = np.empty(depth, dtype=np.int64)
        for k in range(keys.shape[0]):
            h = _mix(keys[k] ^ skey)
            h1 = h & m32
            h2 = h >> np.uint64(32)
            lo = np.uint32(0xFFFFFFFF)
            for i in range(depth):
                g = (h1 + np.uint64(i) * h2) & m32
                c = np.int64((g * w) >> np.uint64(32))
                cols[i] = c
                v = table[i, c]
                if v < lo:
                    lo = v
            if conservative:
                new = lo + np.uint32(1) if lo != np.uint32(0xFFFFFFFF) else lo
                for i in range(depth):
                    if table[i, cols[i]] < new:
                        table[i, cols[i]] = new
            else:
                for i in range(depth):
                    if table[i, cols[i]] != np.uint32(0xFFFFFFFF):
                        table[i, cols[i]] += np.uint32(1)

    return add, _mix


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    t_start = time.monotonic()
    p = QUICK if quick else FULL
    n, reps = p["n_keys"], p["reps"]
    keys = block_hash_stream(n, ZIPF_A, SEED)
    keys_list = keys.tolist()  # prepared outside every timer
    exact = Counter(keys_list)
    holder: dict[str, object] = {}

    def fresh(key: str, **kw) -> Callable[[], None]:
        return lambda: holder.__setitem__(key, CountMinSketch(EPS, DELTA, seed=SEED, **kw))

    # the estimate subject queries a sketch filled once, outside the timers
    filled = CountMinSketch(EPS, DELTA, seed=SEED)
    filled.add(keys)
    subjects: list[Subject] = [
        # exact baselines: collections.Counter over the array as given / over a prepared list
        ("Counter.update(ndarray)", lambda: Counter().update(keys), None),
        ("Counter.update(list)", lambda: Counter().update(keys_list), None),
        ("dict lookup (list)", lambda: list(map(exact.__getitem__, keys_list)), None),
        # the sketch through its public API (validation included)
        ("cms conservative add", lambda: holder["cu"].add(keys), fresh("cu", conservative=True)),
        ("cms standard add", lambda: holder["std"].add(keys), fresh("std", conservative=False)),
        ("cms estimate", lambda: filled.estimate(keys), None),
        (f"cms conservative add, top_k={TOP_K}", lambda: holder["hh"].add(keys), fresh("hh", top_k=TOP_K)),
        (
            f"cms conservative add, aging W={AGING_WINDOW}",
            lambda: holder["age"].add(keys),
            fresh("age", aging_window=AGING_WINDOW),
        ),
    ]
    if p["numba"]:  # competitor: the same algorithm in Numba, compiled outside the timers
        nb_add, nb_mix = _numba_kernels()
        skey = np.uint64(nb_mix(np.uint64(SEED)))
        shape = (filled.depth, filled.width)
        nb_add(np.zeros(shape, dtype=np.uint32), keys[:1000], skey, True)
        nb_add(np.zeros(shape, dtype=np.uint32), keys[:1000], skey, False)

        def nb_fresh(key: str) -> Callable[[], None]:
            return lambda: holder.__setitem__(key, np.zeros(shape, dtype=np.uint32))

        subjects += [
            ("numba conservative add", lambda: nb_add(holder["nb_cu"], keys, skey, True), nb_fresh("nb_cu")),
            ("numba standard add", lambda: nb_add(holder["nb_std"], keys, skey, False), nb_fresh("nb_std")),
        ]
    samples = _interleaved(subjects, reps)
    cu, std = holder["cu"], holder["std"]
    assert isinstance(cu, CountMinSketch) and isinstance(std, CountMinSketch)
    if p["numba"]:
        assert np.array_equal(holder["nb_cu"], cu.counters()), "numba kernel disagrees with the sketch"
        assert np.array_equal(holder["nb_std"], std.counters()), "numba kernel disagrees with the sketch"
    hh_sketch = holder["hh"]
    assert isinstance(hh_sketch, CountMinSketch)
    hh = hh_sketch.heavy_hitters()

    # --- accuracy on the same stream (not a timing; shows what conservative update buys) -----
    uniq, cnt = np.unique(keys, return_counts=True)
    over_cu = cu.estimate(uniq).astype(np.int64) - cnt
    over_std = std.estimate(uniq).astype(np.int64) - cnt
    true_top = [k for k, _ in exact.most_common(TOP_K)]
    top_found = len(set(true_top) & {k for k, _ in hh})

    # --- summary -----------------------------------------------------------------------------
    def rate(name: str) -> dict[str, float]:
        return spread([n / w for w, _ in samples[name]])

    def cpu_rate(name: str) -> float:
        return statistics.median(n / c for _, c in samples[name] if c > 0)

    def note(name: str, extra: str = "") -> str:
        base = f"thread-CPU median {cpu_rate(name) / 1e6:.1f} M/s"
        return f"{base}; {extra}" if extra else base

    stream = f"{n} Zipf({ZIPF_A}) keys through splitmix64, {uniq.size} distinct; eps={EPS} delta={DELTA} ({cu.width}x{cu.depth})"
    rows: list[SummaryRow] = []
    for base in ("Counter.update(ndarray)", "Counter.update(list)", "dict lookup (list)"):
        rows.append(
            SummaryRow.from_spread(
                rate(base),
                metric="throughput",
                subject=base,
                unit="keys/s",
                n=len(samples[base]),
                notes=note(base, "exact baseline; " + stream),
            )
        )
    pairs = [
        ("cms conservative add", "Counter.update(ndarray)"),
        ("cms conservative add", "Counter.update(list)"),
        ("cms standard add", "Counter.update(ndarray)"),
        ("cms standard add", "Counter.update(list)"),
        ("cms estimate", "dict lookup (list)"),
        (f"cms conservative add, top_k={TOP_K}", "Counter.update(ndarray)"),
        (f"cms conservative add, top_k={TOP_K}", "Counter.update(list)"),
        (f"cms conservative add, aging W={AGING_WINDOW}", "Counter.update(ndarray)"),
        (f"cms conservative add, aging W={AGING_WINDOW}", "Counter.update(list)"),
    ]
    if p["numba"]:
        pairs += [
            ("cms conservative add", "numba conservative add"),
            ("cms standard add", "numba standard add"),
        ]
    for subject, base in pairs:
        paired = spread([b[0] / a[0] for a, b in zip(samples[subject], samples[base])])
        extra = f"per-round paired ratio median {paired['median']:.1f}x (p10 {paired['p10']:.1f}, p90 {paired['p90']:.1f})"
        if subject == f"cms conservative add, top_k={TOP_K}":
            extra += f"; found {top_found}/{TOP_K} true top-{TOP_K} keys"
        if subject == "cms conservative add" and base.startswith("Counter"):
            ratio = rate(subject)["median"] / rate(base)["median"]
            verdict = "met" if ratio >= ACCEPT_RATIO and rate(subject)["median"] >= ACCEPT_KEYS_S else "NOT met"
            extra += f"; acceptance (>= {ACCEPT_KEYS_S / 1e6:.0f} M keys/s and >= {ACCEPT_RATIO:.0f}x {base}): {verdict}"
        rows.append(
            SummaryRow.from_spread(
                rate(subject),
                metric="throughput",
                subject=subject,
                unit="keys/s",
                baseline=base,
                baseline_value=rate(base)["median"],
                n=len(samples[subject]),
                notes=note(subject, extra),
            )
        )
    eps_n = EPS * cu.total
    rows.append(
        SummaryRow(
            metric="mean_overestimate",
            subject="cms conservative",
            value=float(over_cu.mean()),
            unit="counts",
            baseline="cms standard",
            baseline_value=float(over_std.mean()),
            n=int(uniq.size),
            notes=(
                f"over distinct keys; eps*N={eps_n:.0f}; keys within eps*N: conservative "
                f"{np.mean(over_cu <= eps_n):.4f}, standard {np.mean(over_std <= eps_n):.4f}; "
                f"min overestimate {int(min(over_cu.min(), over_std.min()))} (never negative)"
            ),
        )
    )
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start)
    write_raw(
        NAME,
        "raw.csv",
        ["subject", "rep", "wall_s", "thread_cpu_s", "keys", "keys_per_s"],
        [(name, i, w, c, n, n / w) for name, s in samples.items() for i, (w, c) in enumerate(s)],
        results_root,
    )
    print_table(rows)
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """The speed-up over the same-run baseline of every row that has one (log scale)."""
    from pathlib import Path

    from experiments.plotstyle import speedup_chart
    from quillcache.results import read_summary

    name = NAME
    return speedup_chart(read_summary(name, results_root), "Count-min sketch vs exact counting", Path(out_dir) / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
