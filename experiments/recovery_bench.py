"""Recovery time under damage: is log recovery linear in file size whatever the damage?

The two damage patterns that were quadratic (issue 11, item 2), each at three sizes, against a
clean log of the same size recovered the same way in the same run (the baseline):

- ``ssd_log_flip_every_second``: an SSD-tier log of N group-commit records (one 49-byte entry
  each, the tier's own payload format) with one byte flipped in every second record, scanned the
  way the tier reopens it (the WAL's ``salvage`` mode); baseline: the same log undamaged;
- ``wal_fake_headers``: a WAL with a valid header, a garbage first record, then fake record
  headers every 24 bytes whose lengths claim the rest of the file (each passes every check but
  the crc), scanned with ``wal.scan`` (``point_in_time``, the index's mode; baseline: ``wal.scan``
  of a clean ART index log of the same size) and opened as an ART index's ``art.wal``
  (``open_index('art')``; baseline: ``open_index('art')`` replaying that clean log).

Timing (``time_interleaved``): every cell is called once untimed first (imports, first touch of
the images); then each of ``reps`` rounds visits every size of every pattern, the damaged and the
clean cell of a size back to back, in alternating order from round to round. The timer encloses
the scan or the ``open_index`` call only: writing an image into a fresh index directory happens
before it, and closing an opened index after it.

Reported per cell: the damaged median with p10/p90 (``scan_s``, baseline the clean median),
``damaged_over_clean`` (the median and p10/p90 of the per-round ratios: the damage's cost), and
``scan_s_per_mib`` for damaged and clean (per-round seconds / MiB). ``per_mib_growth``: per round,
time per MiB at the largest size over that at the smallest; linear recovery keeps it near 1
(within ``FLAT_WITHIN``), a quadratic one near the size ratio. Writes ``results/recovery/``;
``plot`` draws ``paper/figures/recovery.png``.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from experiments.microbench import bench_main
from quillcache.durability import wal
from quillcache.results import SummaryRow, print_table, spread, write_raw, write_summary
from quillcache.store import ssd_log

NAME = "recovery"
FULL = dict(reps=7, records=(4000, 16000, 64000), mib=(1, 4, 16))
QUICK = dict(reps=3, records=(250, 1000), mib=(1, 2))
SEED = 20261124
FLAT_WITHIN = 1.25  # per_mib_growth in [1/FLAT_WITHIN, FLAT_WITHIN]: time per MiB flat
ART_BATCH_ENTRIES = 256  # replicas per put() while building a clean ART log


def ssd_log_image(n_records: int, *, damage: bool, rng: random.Random) -> bytes:
    """An SSD-tier log generation image: N batch records of one put entry each; with ``damage``,
    one byte flipped inside every second record."""
    header = wal.encode_header(rng.getrandbits(64), 1)
    epoch = wal.decode_header(header, "image").epoch
    out = bytearray(header)
    starts = []
    for lsn in range(1, n_records + 1):
        entry = ssd_log.ENTRY.pack(ssd_log.PUT, rng.randbytes(24), 0, lsn * 4096, 4096, rng.getrandbits(32))
        payload = ssd_log.encode_record(ssd_log.KIND_BATCH, [entry])
        crc = wal._record_crc(epoch, lsn, lsn - 1, payload)
        starts.append(len(out))
        out += struct.pack("<IIQQ", len(payload), crc, lsn, lsn - 1) + payload
    if damage:
        for i in range(1, n_records, 2):
            pos = starts[i] + wal.RECORD_HEADER_BYTES + rng.randrange(ssd_log.ENTRY_BYTES)
            out[pos] ^= 0xFF
    return bytes(out)


def fake_header_image(size_bytes: int, rng: random.Random) -> bytes:
    """A valid WAL header, a garbage first record, then a fake record header every 24 bytes whose
    length claims the rest of the file (lsn and durable LSN plausible, crc wrong)."""
    out = bytearray(wal.encode_header(rng.getrandbits(64), 1))
    out += rng.randbytes(wal.RECORD_HEADER_BYTES)  # the garbage first record
    while len(out) + wal.RECORD_HEADER_BYTES <= size_bytes:
        rest = size_bytes - len(out) - wal.RECORD_HEADER_BYTES
        out += struct.pack("<IIQQ", rest, rng.getrandbits(32), 2, 1)
    return bytes(out.ljust(size_bytes, b"\0"))


def art_wal_image(size_bytes: int, rng: random.Random, workdir: Path) -> tuple[bytes, int]:
    """A clean ART index log (``art.wal``) of at least ``size_bytes``, less than one batch over:
    batches of ``ART_BATCH_ENTRIES`` random replicas put through the index itself, the log read
    before ``close()`` would checkpoint it. Returns (image, records)."""
    from quillcache.index import ResidencyEntry, open_index
    from quillcache.types import CacheTier

    d = workdir / "art-build"
    shutil.rmtree(d, ignore_errors=True)
    ix = open_index("art", str(d))
    try:
        records = 0
        while ix._wal.size_bytes < size_bytes:
            ix.put([ResidencyEntry(rng.getrandbits(64), f"node-{rng.randrange(4)}", CacheTier.DRAM, rng.randbytes(16),
                                   0, rng.randrange(1 << 20) * 4096, 4096) for _ in range(ART_BATCH_ENTRIES)])
            records += 1
        ix.flush()
        image = (d / "art.wal").read_bytes()
    finally:
        ix.close()
        shutil.rmtree(d, ignore_errors=True)
    return image, records


@dataclass(frozen=True)
class Cell:
    """One timed operation. ``prepare()`` (untimed) makes its argument; the timer encloses
    ``run(argument)`` only; when ``run`` returns a callable (e.g. an opened index's ``close``), it is
    called after the timer stops."""

    key: Hashable
    run: Callable[[object], object]
    prepare: Callable[[], object] = field(default=lambda: None)


def time_interleaved(pairs: Sequence[tuple[Cell, Cell]], reps: int,
                     clock: Callable[[], float] = time.perf_counter) -> dict[Hashable, list[float]]:
    """Seconds of every cell in each of ``reps`` rounds (key -> ``reps`` samples, in round order).

    Every cell is called once untimed first (warm-up: imports, first touch). Each round then visits
    every pair in order, its two cells back to back: the first one first in even rounds, the second
    one first in odd rounds, so neither always runs after the other."""

    def once(cell: Cell) -> float:
        arg = cell.prepare()
        t0 = clock()
        after = cell.run(arg)
        elapsed = clock() - t0
        if callable(after):
            after()
        return elapsed

    for pair in pairs:
        for cell in pair:
            once(cell)
    out: dict[Hashable, list[float]] = {c.key: [] for pair in pairs for c in pair}
    if len(out) != 2 * len(pairs):
        raise ValueError("time_interleaved: two cells share a key")
    for rep in range(reps):
        for pair in pairs:
            for cell in pair if rep % 2 == 0 else pair[::-1]:
                out[cell.key].append(once(cell))
    return out


def _art_dir(image: bytes, workdir: Path) -> Path:
    """A fresh index directory holding ``image`` as its ``art.wal`` (nothing else)."""
    d = workdir / "art"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "art.wal").write_bytes(image)
    return d


def _open_art(d: Path) -> Callable[[], None] | None:
    """``open_index('art')`` of ``d``: the opened index's ``close`` (to call untimed), or None when
    the log is refused (a correct outcome for a damaged one; what is timed is how long it takes)."""
    from quillcache.durability.wal import WalError
    from quillcache.index import open_index
    from quillcache.index.base import NotAnIndexError

    try:
        return open_index("art", str(d)).close
    except (NotAnIndexError, WalError):
        return None


def _check_art_outcomes(fake: bytes, clean: bytes, records: int, workdir: Path) -> None:
    """Untimed: the damaged log is refused and the clean one replays every record it holds."""
    from quillcache.index import open_index
    from quillcache.index.base import NotAnIndexError

    try:
        open_index("art", str(_art_dir(fake, workdir))).close()
    except NotAnIndexError:
        pass
    else:
        raise AssertionError("open_index('art') accepted a log of fake record headers")
    ix = open_index("art", str(_art_dir(clean, workdir)))
    try:
        assert ix.replayed_records == records, (ix.replayed_records, records)
    finally:
        ix.close()


def _salvage(image: bytes) -> None:
    wal.scan_bytes(image, "bench", mode=ssd_log.SCAN_MODE)


def _scan_quiet(image: bytes) -> None:
    try:
        wal.scan_bytes(image, "bench", mode="point_in_time")
    except wal.WalCorruptionError:
        pass  # refusing is a correct outcome; the time to decide is what is measured


def _pairs(cfg: dict, rng: random.Random, workdir: Path) -> tuple[list[tuple[Cell, Cell]], dict]:
    """The (damaged, clean) cells of every pattern and size, and per cell key its (pattern,
    subject, size_param, file_bytes, notes)."""
    pairs: list[tuple[Cell, Cell]] = []
    info: dict = {}
    for n in cfg["records"]:
        damaged, clean = ssd_log_image(n, damage=True, rng=rng), ssd_log_image(n, damage=False, rng=rng)
        rep, recs = wal.scan_bytes(damaged, "bench", mode=ssd_log.SCAN_MODE)
        note = f"{len(recs)} records recovered, {len(rep.damaged_lsns)} damaged ranges reported"
        pair = []
        for image, subject in ((damaged, "salvage scan, damaged"), (clean, "salvage scan, clean log")):
            key = ("ssd_log_flip_every_second", subject, n)
            pair.append(Cell(key, _salvage, lambda im=image: im))
            info[key] = ("ssd_log_flip_every_second", subject, n, len(image), note)
        pairs.append(tuple(pair))
    for mib_n in cfg["mib"]:
        size = mib_n << 20
        fake = fake_header_image(size, rng)
        clean, records = art_wal_image(size, rng, workdir)
        _check_art_outcomes(fake, clean, records, workdir)
        note = f"clean log: an ART index log of {records} batches, {len(clean)} bytes"
        for stem, fn, prepare in (("wal.scan", _scan_quiet, lambda im: (lambda: im)),
                                  ("open_index('art')", _open_art, lambda im: (lambda: _art_dir(im, workdir)))):
            pair = []
            for image, what in ((fake, "fake headers"), (clean, "clean log")):
                key = ("wal_fake_headers", f"{stem}, {what}", mib_n)
                pair.append(Cell(key, fn, prepare(image)))
                info[key] = (*key, len(image), note)
            pairs.append(tuple(pair))
    return pairs, info


def _rows(samples: dict, info: dict, reps: int) -> list[SummaryRow]:
    rows: list[SummaryRow] = []
    mib = {k: info[k][3] / 2**20 for k in samples}
    damaged = [k for k in samples if not k[1].endswith("clean log")]
    for k in damaged:
        pattern, subject, size_param, file_bytes, note = info[k]
        base = (pattern, subject.rsplit(", ", 1)[0] + ", clean log", size_param)
        params = {"pattern": pattern, "file_bytes": file_bytes}
        if pattern == "ssd_log_flip_every_second":
            params["records"] = size_param
        bad, ok = samples[k], samples[base]
        rows.append(SummaryRow.from_spread(spread(bad), metric="scan_s", subject=subject, unit="s", baseline=base[1],
                                           baseline_value=spread(ok)["median"], n=len(bad), notes=note,
                                           params={**params, "baseline_file_bytes": info[base][3]}))
        rows.append(SummaryRow.from_spread(spread([b / o for b, o in zip(bad, ok)]), metric="damaged_over_clean",
                                           subject=subject, unit="x", n=len(bad), params=params,
                                           notes=f"per-round ratio to {base[1]} ({info[base][3]} bytes), same round"))
        for key, s in ((k, bad), (base, ok)):
            rows.append(SummaryRow.from_spread(spread([x / mib[key] for x in s]), metric="scan_s_per_mib",
                                               subject=info[key][1], unit="s/MiB", n=len(s),
                                               params={**params, "file_bytes": info[key][3]}))
    by_subject: dict[tuple[str, str], list] = {}
    for k in samples:
        by_subject.setdefault((k[0], k[1]), []).append(k)
    for (pattern, subject), keys in by_subject.items():
        small, large = min(keys, key=lambda k: mib[k]), max(keys, key=lambda k: mib[k])
        if small == large:
            continue
        growth = [(tl / mib[large]) / (ts / mib[small]) for ts, tl in zip(samples[small], samples[large])]
        rows.append(SummaryRow.from_spread(
            spread(growth), metric="per_mib_growth", subject=subject, unit="x", n=len(growth),
            params={"pattern": pattern, "file_bytes": info[large][3], "smallest_file_bytes": info[small][3],
                    "size_ratio": round(mib[large] / mib[small], 3), "flat_within": FLAT_WITHIN},
            notes="per round: s/MiB at the largest size / at the smallest (linear: 1; quadratic: ~size_ratio)"))
    assert all(r.n == reps for r in rows)
    return rows


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    rng = random.Random(SEED)
    workdir = Path(tempfile.mkdtemp(prefix="qc-recovery-"))
    try:
        pairs, info = _pairs(cfg, rng, workdir)
        samples = time_interleaved(pairs, cfg["reps"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    raw = [(*info[k][:4], rep, s) for k, ss in samples.items() for rep, s in enumerate(ss)]
    rows = _rows(samples, info, cfg["reps"])
    write_raw(NAME, "raw.csv", ["pattern", "subject", "size_param", "file_bytes", "rep", "seconds"], raw, results_root)
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start)
    print_table(rows, title="recovery under damage")
    return rows


def plot(results_root: str | None = None, out_dir: str | os.PathLike = "paper/figures") -> Path:
    """Time per MiB (median, p10-p90 bars) against file size for every damaged log and its clean
    baseline (dashed): flat lines mean linear recovery."""
    from experiments.plotstyle import PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    per = df[df["metric"] == "scan_s_per_mib"]
    fig, ax = figure(7.0, 3.4)
    for colour, (subject, part) in zip(PALETTE, per.groupby("subject", sort=False)):
        part = part.sort_values("file_bytes")
        y = part["value"] * 1e3
        err = [(y - part["p10"] * 1e3).clip(lower=0), (part["p90"] * 1e3 - y).clip(lower=0)]
        ax.errorbar(part["file_bytes"] / 2**20, y, yerr=err, marker="o", capsize=2, label=subject, color=colour,
                    linestyle="--" if subject.endswith("clean log") else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    style_axes(ax, xlabel="log file size (MiB, log scale)", ylabel="ms per MiB scanned (log)",
               title="Recovery time per MiB, damaged and clean (flat = linear)")
    legend(ax)
    return save(fig, Path(out_dir) / "recovery.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
