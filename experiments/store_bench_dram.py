"""DRAM tier put+get throughput vs plain memcpy, same run (issue 4, item 5b).

Subjects, per block size (64 KiB, 2 MiB, 32 MiB; REFERENCE §2), each moving the same number of
bytes from the same pre-touched, random source blocks:

- ``memcpy`` (baseline): numpy slice assignment of each block into a pre-touched destination
  buffer the size of the store, at consecutive offsets (wrapping).
- ``LocalKvStore``: fill the store (``put``: one memcpy into the segment plus the allocator and
  the key map), read every block back with ``get`` (zero-copy read-only view), then ``delete``
  all (untimed), until the byte budget is moved. ``put+get`` rate = bytes / (put time + get time).
  Acceptance: 2 MiB ``put+get`` >= 0.5x memcpy.
- Also reported: ``get_into`` (copy out: the consumer's memcpy, so ``put+get_into`` is two copies
  against the baseline's one) and the same store with ``checksum=True`` (crc32c at put,
  ``get(verify=True)``). ``get_into`` writes into the baseline's own store-sized destination at the
  baseline's offsets (block i at ``(i % slots) * size``, ``_dst_slot``), so neither copy lands in a
  block-sized buffer that stays in the CPU cache while the other streams through memory.

Alignment: the sources, the destination and the store's segments are all page-aligned (as an
engine's pinned KV cache is). On this machine's CPU a copy between buffers whose addresses differ
within a cache line (a NumPy array starts 16 bytes into its page) runs markedly slower, for the
kernel's socket copies and for ``memcpy`` alike (``quillcache.alloc.buffers``); the baseline and the
store are compared on equal terms.

Rates are GB/s (10^9 bytes) of block payload; each subject's cell is timed as a whole loop with
``time.perf_counter``; subjects are interleaved within each repetition, in reverse order on odd ones;
medians over ``reps`` (>= 5 in full mode) with p10/p90. Writes ``results/store_dram/summary.csv`` (metric ``throughput``;
``operation`` and ``block_bytes`` columns) and ``raw.csv``; ``plot`` draws ``store_dram.png``.
"""

from __future__ import annotations

import time

import numpy as np

from experiments.microbench import bench_main
from quillcache.alloc.buffers import aligned_empty
from quillcache.results import SummaryRow, spread, write_raw, write_summary
from quillcache.store.dram import LocalKvStore
from quillcache.store.keys import StoreKey

NAME = "store_dram"
GB = 1e9
SIZES = (64 << 10, 2 << 20, 32 << 20)
FULL = dict(reps=7, store_bytes=256 << 20, cell_bytes=1 << 30, source_bytes=64 << 20)
QUICK = dict(reps=3, store_bytes=64 << 20, cell_bytes=64 << 20, source_bytes=32 << 20)
BASELINE = "numpy memcpy into a pre-touched buffer"
SEED = 20240611
NO_BASELINE = ("get", "crc_get")  # zero-copy views (crc_get: a checksum pass over a view)


def _label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


def _sources(size: int, source_bytes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random, touched source blocks (at least 2, so no block is copied from itself twice in a row)."""
    n = max(2, source_bytes // size)
    out = []
    for _ in range(n):
        block = aligned_empty(size)  # page-aligned like the store's segments (module docstring: alignment)
        block[:] = rng.integers(0, 256, size, dtype=np.uint8)
        out.append(block)
    return out


def _dst_slot(dst: np.ndarray, size: int, i: int) -> np.ndarray:
    """Where block ``i`` is copied to: the store-sized ``dst`` wraps at ``(i % slots) * size``."""
    off = (i % (dst.nbytes // size)) * size
    return dst[off:off + size]


def _memcpy_cell(dst: np.ndarray, srcs: list[np.ndarray], n_blocks: int) -> float:
    size = srcs[0].nbytes
    slot = _dst_slot
    pc = time.perf_counter
    t0 = pc()
    for i in range(n_blocks):
        slot(dst, size, i)[:] = srcs[i % len(srcs)]
    return pc() - t0


def _store_cell(store: LocalKvStore, keys: list[StoreKey], srcs: list[np.ndarray], n_blocks: int,
                dst: np.ndarray, verify: bool) -> tuple[float, float, float]:
    """(put seconds, get seconds, get_into seconds) for ``n_blocks`` blocks in store-sized rounds;
    ``get_into`` copies block i into ``_dst_slot(dst, size, i)``, as ``_memcpy_cell`` does."""
    size = srcs[0].nbytes
    slot = _dst_slot
    per_round = len(keys)
    put, get, get_into, delete = store.put, store.get, store.get_into, store.delete
    pc = time.perf_counter
    t_put = t_get = t_into = 0.0
    done = 0
    while done < n_blocks:
        m = min(per_round, n_blocks - done)
        ks = keys[:m]
        t0 = pc()
        for i, k in enumerate(ks):
            put(k, srcs[(done + i) % len(srcs)])
        t1 = pc()
        for k in ks:
            get(k, verify=verify)
        t2 = pc()
        for i, k in enumerate(ks):
            get_into(k, slot(dst, size, done + i))
        t3 = pc()
        for k in ks:
            delete(k)
        t_put += t1 - t0
        t_get += t2 - t1
        t_into += t3 - t2
        done += m
    return t_put, t_get, t_into


def _check_round_trip(store: LocalKvStore, srcs: list[np.ndarray]) -> None:
    """The benchmark measures a store that really stores: verify once per configuration."""
    k = StoreKey(0, b"\x00" * 16)
    store.put(k, srcs[1])
    assert bytes(store.get(k)) == srcs[1].tobytes()
    store.delete(k)


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    rng = np.random.default_rng(SEED)
    raw: list[tuple] = []  # (size_bytes, subject, rep, seconds, bytes)
    rows: list[SummaryRow] = []
    store_bytes = cfg["store_bytes"]
    dst = aligned_empty(store_bytes, pretouch=True)  # pre-touched and page-aligned, like the store's segments
    plain = LocalKvStore(store_bytes, segment_bytes=store_bytes, alignment_bytes=4096)
    checked = LocalKvStore(store_bytes, segment_bytes=store_bytes, alignment_bytes=4096, checksum=True)
    table = []
    for size in SIZES:
        srcs = _sources(size, cfg["source_bytes"], rng)
        n_blocks = max(1, cfg["cell_bytes"] // size)
        keys = [StoreKey(i + 1, b"\x01" * 16) for i in range(store_bytes // size)]
        moved = n_blocks * size
        _check_round_trip(plain, srcs)
        _check_round_trip(checked, srcs)
        # warm-up (untimed): first use of every page and code path
        _memcpy_cell(dst, srcs, min(n_blocks, len(keys)))
        _store_cell(plain, keys, srcs, min(n_blocks, len(keys)), dst, False)
        _store_cell(checked, keys, srcs, min(n_blocks, len(keys)), dst, True)
        per = {s: [] for s in ("memcpy", "put", "get", "get_into", "put+get", "put+get_into",
                               "crc_put", "crc_get", "crc_put+get")}
        subjects = {"memcpy": lambda: _memcpy_cell(dst, srcs, n_blocks),
                    "plain": lambda: _store_cell(plain, keys, srcs, n_blocks, dst, False),
                    "checked": lambda: _store_cell(checked, keys, srcs, n_blocks, dst, True)}
        for rep in range(cfg["reps"]):
            order = list(subjects) if rep % 2 == 0 else list(reversed(subjects))  # no order bias
            timed = {name: subjects[name]() for name in order}
            t_copy = timed["memcpy"]
            t_put, t_get, t_into = timed["plain"]
            c_put, c_get, _ = timed["checked"]
            cells = {"memcpy": t_copy, "put": t_put, "get": t_get, "get_into": t_into, "put+get": t_put + t_get,
                     "put+get_into": t_put + t_into, "crc_put": c_put, "crc_get": c_get, "crc_put+get": c_put + c_get}
            for subject, seconds in cells.items():
                per[subject].append(moved / seconds / GB)
                raw.append((size, subject, rep, f"{seconds:.6f}", moved))
        base = spread(per["memcpy"])
        label = _label(size)
        descr = {
            "memcpy": (BASELINE, ""),
            "put": ("LocalKvStore.put (one memcpy into the segment)", ""),
            "get": ("LocalKvStore.get (zero-copy read-only view)", ""),
            "get_into": ("LocalKvStore.get_into (copy out into the baseline's destination)", ""),
            "put+get": ("LocalKvStore put + zero-copy get", "acceptance: >= 0.5x memcpy at 2 MiB"),
            "put+get_into": ("LocalKvStore put + get_into", "two copies vs the baseline's one"),
            "crc_put": ("LocalKvStore(checksum=True).put (memcpy + crc32c)", ""),
            "crc_get": ("LocalKvStore(checksum=True).get(verify=True) (crc32c)", ""),
            "crc_put+get": ("LocalKvStore(checksum=True) put + verified get", ""),
        }
        for subject, samples in per.items():
            sp = spread(samples)
            what, extra = descr[subject]
            notes = f"{n_blocks} blocks = {moved / GB:.2f} GB per rep; {what}" + (f"; {extra}" if extra else "")
            params = {"block_bytes": size, "operation": subject}
            if subject in NO_BASELINE:  # a zero-copy view moves no bytes: a memcpy is no comparison
                rows.append(SummaryRow.from_spread(sp, metric="throughput", subject=f"LocalKvStore {subject}",
                                                   unit="GB/s", n=len(samples), notes=notes, params=params))
            elif subject == "memcpy":
                rows.append(SummaryRow.from_spread(sp, metric="throughput", subject=BASELINE, unit="GB/s",
                                                   n=len(samples), notes=notes, params=params))
            else:
                rows.append(SummaryRow.from_spread(sp, metric="throughput", subject=f"LocalKvStore {subject}",
                                                   unit="GB/s", baseline=BASELINE, baseline_value=base["median"],
                                                   n=len(samples), notes=notes, params=params))
            table.append((label, subject, sp["median"], sp["p10"], sp["p90"], sp["median"] / base["median"]))
    plain.close()
    checked.close()
    write_raw(NAME, "raw.csv", ("block_bytes", "subject", "rep", "seconds", "bytes"), raw, results_root)
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start)  # last: meta
    print(f"{'block':>7} {'subject':<14} {'GB/s':>7} {'p10':>7} {'p90':>7} {'x memcpy':>9}")
    for label, subject, med, p10, p90, ratio in table:
        print(f"{label:>7} {subject:<14} {med:7.2f} {p10:7.2f} {p90:7.2f} {ratio:9.2f}")
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """``store_dram.png``: GB/s per block size for the memcpy baseline and the store's copying
    operations (the zero-copy ``get`` is left out: it moves no bytes)."""
    from pathlib import Path

    from experiments.plotstyle import BASELINE as BASE_COLOUR
    from experiments.plotstyle import OURS, PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    ops = [("memcpy", "memcpy (baseline)", BASE_COLOUR), ("put", "put", OURS),
           ("get_into", "get_into (copy out)", PALETTE[5]), ("put+get", "put + zero-copy get", PALETTE[2]),
           ("crc_put+get", "put + get, crc32c on", PALETTE[3])]
    sizes = sorted(int(b) for b in df["block_bytes"].unique())
    fig, ax = figure(7.0, 3.4)
    w = 0.8 / len(ops)
    for i, (op, label, colour) in enumerate(ops):
        part = df[df["operation"] == op].set_index("block_bytes")
        vals = [float(part.loc[b, "value"]) for b in sizes]
        err = [[v - float(part.loc[b, "p10"]) for v, b in zip(vals, sizes)],
               [float(part.loc[b, "p90"]) - v for v, b in zip(vals, sizes)]]
        ax.bar(np.arange(len(sizes)) + (i - (len(ops) - 1) / 2) * w, vals, w, yerr=np.clip(err, 0, None),
               capsize=2, label=label, color=colour)
    ax.set_xticks(np.arange(len(sizes)))
    ax.set_xticklabels([_label(b) + " blocks" for b in sizes])
    style_axes(ax, ylabel="GB/s (median, p10-p90)", title="DRAM tier vs memcpy, same run (higher is better)")
    legend(ax, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return save(fig, Path(out_dir) / "store_dram.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
