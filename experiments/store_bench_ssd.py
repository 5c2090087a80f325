"""SSD tier sustained put throughput vs raw file baselines at equal durability (issue 4, item 5a).

Every subject writes the same number of blocks of the same size into a fresh directory on the
local disk (``tempfile.mkdtemp()``), with the durability of an acknowledged SsdTier put: when a
block (or batch) is counted, its bytes AND its name are durable.

- ``raw_fsync_each``: per block, create a file, write, fsync it, fsync the directory.
- ``raw_batched``: per batch of ``BATCH`` blocks, create and write the files, fsync each, fsync
  the directory once (the textbook batched atomic-publish baseline).
- ``tier_slab_put`` / ``tier_files_put``: ``SsdTier.put`` per block, each layout.
- ``tier_slab_put_many`` / ``tier_files_put_many``: ``SsdTier.put_many`` of ``BATCH`` blocks.

Rates are MB/s (10^6 bytes) of block payload over the whole timed loop, which includes
everything the subject does (crc32c, slab creation with fallocate, log records, renames).
Subjects are interleaved within each repetition; medians over ``reps`` with p10/p90.
Ratios: ``put_many`` vs ``raw_batched`` (acceptance: slab layout >= 0.7x), ``put`` vs
``raw_fsync_each``. Writes ``results/store_ssd/summary.csv`` (``block_bytes`` column) and
``raw.csv``; ``plot`` draws ``store_ssd.png``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from experiments.microbench import bench_main
from quillcache.durability.fs import RealFs
from quillcache.results import SummaryRow, print_table, spread, write_raw, write_summary
from quillcache.store.keys import StoreKey
from quillcache.store.ssd import SsdTier

NAME = "store_ssd"
BATCH = 16
MB = 1e6
# per block size: bytes written per cell for batched subjects / for per-block-fsync subjects
FULL = dict(reps=5, sizes=(64 << 10, 2 << 20), batched_bytes=256 << 20, single_bytes=64 << 20)
QUICK = dict(reps=2, sizes=(64 << 10, 2 << 20), batched_bytes=8 << 20, single_bytes=4 << 20)
SLAB_BYTES = 64 << 20


_FS = RealFs()  # the raw-fsync baselines sync directories the way the tier does


def _raw_fsync_each(d: str, n: int, data: bytes) -> None:
    for i in range(n):
        fd = os.open(f"{d}/b{i:08d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        _FS.fsync_dir(d)


def _raw_batched(d: str, n: int, data: bytes) -> None:
    for start in range(0, n, BATCH):
        fds = []
        for i in range(start, min(n, start + BATCH)):
            fd = os.open(f"{d}/b{i:08d}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, data)
            fds.append(fd)
        for fd in fds:
            os.fsync(fd)
            os.close(fd)
        _FS.fsync_dir(d)


def _key(i: int) -> StoreKey:
    return StoreKey(i, b"\x11" * 16)


def _tier(d: str, layout: str, n: int, size: int) -> SsdTier:
    cap = (n + BATCH) * (size + 8192) + 2 * SLAB_BYTES
    return SsdTier(f"{d}/tier", capacity_bytes=cap, layout=layout, slab_bytes=SLAB_BYTES)


def _tier_put(d: str, n: int, data: bytes, layout: str) -> None:
    t = _tier(d, layout, n, len(data))
    for i in range(n):
        t.put(_key(i), data)
    t.close()


def _tier_put_many(d: str, n: int, data: bytes, layout: str) -> None:
    t = _tier(d, layout, n, len(data))
    view = memoryview(data)
    for start in range(0, n, BATCH):
        t.put_many([(_key(i), view) for i in range(start, min(n, start + BATCH))])
    t.close()


SUBJECTS = {
    "raw_fsync_each": (lambda d, n, data: _raw_fsync_each(d, n, data), "single"),
    "tier_slab_put": (lambda d, n, data: _tier_put(d, n, data, "slab"), "single"),
    "tier_files_put": (lambda d, n, data: _tier_put(d, n, data, "files"), "single"),
    "raw_batched": (lambda d, n, data: _raw_batched(d, n, data), "batched"),
    "tier_slab_put_many": (lambda d, n, data: _tier_put_many(d, n, data, "slab"), "batched"),
    "tier_files_put_many": (lambda d, n, data: _tier_put_many(d, n, data, "files"), "batched"),
}
BASELINE = {"tier_slab_put": "raw_fsync_each", "tier_files_put": "raw_fsync_each",
            "tier_slab_put_many": "raw_batched", "tier_files_put_many": "raw_batched"}


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    raw: list[tuple] = []  # (block_bytes, subject, rep, MB/s, blocks, seconds)
    for rep in range(cfg["reps"]):
        for size in cfg["sizes"]:
            data = os.urandom(size)
            order = list(SUBJECTS)
            if rep % 2:
                order.reverse()  # interleave, alternating order against drift
            for subject in order:
                fn, kind = SUBJECTS[subject]
                n = max(BATCH, cfg[f"{kind}_bytes"] // size)
                d = tempfile.mkdtemp(prefix="qc-ssd-bench-")
                try:
                    t0 = time.perf_counter()
                    fn(d, n, data)
                    dt = time.perf_counter() - t0
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                raw.append((size, subject, rep, n * size / dt / MB, n, dt))
    write_raw(NAME, "raw.csv", ["block_bytes", "subject", "rep", "put_MBps", "blocks", "seconds"], raw, root=results_root)
    rows = _summarise(raw, cfg)
    write_summary(NAME, rows, root=results_root, profile="quick" if quick else "full", started_at=t_start)
    print_table(rows)
    return rows


def _summarise(raw: list[tuple], cfg: dict) -> list[SummaryRow]:
    rows = []
    for size in cfg["sizes"]:
        stats = {s: spread([r[3] for r in raw if r[0] == size and r[1] == s]) for s in SUBJECTS}
        blocks = {s: next(r[4] for r in raw if r[0] == size and r[1] == s) for s in SUBJECTS}
        for s in SUBJECTS:
            st = stats[s]
            base = BASELINE.get(s)
            note = f"{blocks[s]} blocks per rep ({blocks[s] * size >> 20} MiB)"
            if base is not None:
                b = stats[base]
                note += f"; baseline p10={b['p10']:.4g} p90={b['p90']:.4g}"
                if s == "tier_slab_put_many":
                    ok = st["median"] >= 0.7 * b["median"]
                    note += f"; acceptance >= 0.7x raw_batched: {'PASS' if ok else 'FAIL'}"
            rows.append(SummaryRow.from_spread(st, metric="put_throughput", subject=s, unit="MB/s",
                                               baseline=base or "",
                                               baseline_value=stats[base]["median"] if base else float("nan"),
                                               n=cfg["reps"], notes=note,
                                               params={"block_bytes": size, "batch_blocks": BATCH}))
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """``store_ssd.png``: durable put MB/s per block size; each tier subject beside the raw-file
    baseline of equal durability (log scale: per-block fsync and batched writes differ by decades)."""
    from pathlib import Path

    import numpy as np

    from experiments.plotstyle import BASELINE as BASE_COLOUR
    from experiments.plotstyle import OURS, PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    subjects = [("raw_fsync_each", BASE_COLOUR), ("tier_slab_put", OURS), ("tier_files_put", PALETTE[5]),
                ("raw_batched", PALETTE[3]), ("tier_slab_put_many", PALETTE[2]), ("tier_files_put_many", PALETTE[4])]
    sizes = sorted(int(b) for b in df["block_bytes"].unique())
    fig, ax = figure(7.0, 3.4)
    w = 0.8 / len(subjects)
    for i, (subj, colour) in enumerate(subjects):
        part = df[df["subject"] == subj].set_index("block_bytes")
        vals = [float(part.loc[b, "value"]) for b in sizes]
        err = [[v - float(part.loc[b, "p10"]) for v, b in zip(vals, sizes)],
               [float(part.loc[b, "p90"]) - v for v, b in zip(vals, sizes)]]
        ax.bar(np.arange(len(sizes)) + (i - (len(subjects) - 1) / 2) * w, vals, w, yerr=np.clip(err, 0, None),
               capsize=2, label=subj + (" (baseline)" if subj.startswith("raw") else ""), color=colour)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(sizes)))
    ax.set_xticklabels([f"{b >> 10} KiB blocks" if b < 1 << 20 else f"{b >> 20} MiB blocks" for b in sizes])
    style_axes(ax, ylabel="MB/s durable (log, p10-p90)", title="SSD tier puts vs raw files, equal durability")
    legend(ax, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return save(fig, Path(out_dir) / "store_ssd.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
