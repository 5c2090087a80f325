"""Recovery time under damage: is log recovery linear in file size whatever the damage?

The two damage patterns that were quadratic (issue 11, item 2), each at three sizes, against a
clean log of the same size scanned in the same run (the baseline):

- ``ssd_log_flip_every_second``: an SSD-tier log of N group-commit records (one 49-byte entry
  each, the tier's own payload format) with one byte flipped in every second record, scanned the
  way the tier reopens it (the WAL's ``salvage`` mode), N = 1,000, 2,000 and 4,000;
- ``wal_fake_headers``: a WAL with a valid header, a garbage first record, then fake record
  headers every 24 bytes whose lengths claim the rest of the file (each passes every check but
  the crc), 1, 2 and 8 MiB, scanned with ``wal.scan`` (``point_in_time``, the index's mode) and
  opened as an ART index's ``art.wal``.

Reported per cell: the median scan time of ``reps`` repetitions with p10/p90, and time per MiB;
linear recovery means time per MiB stays flat as the size grows (the ratio to the clean scan of
the same size is the damage's cost). Writes ``results/recovery/``; ``plot`` draws
``paper/figures/recovery.png``.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import tempfile
import time
from pathlib import Path

from experiments.microbench import bench_main
from quillcache.durability import wal
from quillcache.results import SummaryRow, print_table, spread, write_raw, write_summary
from quillcache.store import ssd_log

NAME = "recovery"
FULL = dict(reps=5, records=(1000, 2000, 4000), mib=(1, 2, 8))
QUICK = dict(reps=2, records=(250, 500, 1000), mib=(1, 2))
SEED = 20261124


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


def clean_wal_image(size_bytes: int, rng: random.Random, payload_bytes: int = 4096) -> bytes:
    """A valid WAL of about ``size_bytes``: records of ``payload_bytes`` random bytes from LSN 1."""
    header = wal.encode_header(rng.getrandbits(64), 1)
    epoch = wal.decode_header(header, "image").epoch
    out = bytearray(header)
    lsn = 1
    while len(out) + wal.RECORD_HEADER_BYTES + payload_bytes <= size_bytes:
        payload = rng.randbytes(payload_bytes)
        out += struct.pack("<IIQQ", payload_bytes, wal._record_crc(epoch, lsn, lsn - 1, payload), lsn, lsn - 1)
        out += payload
        lsn += 1
    return bytes(out)


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _open_art(image: bytes, workdir: Path) -> None:
    from quillcache.durability.wal import WalError
    from quillcache.index import open_index
    from quillcache.index.base import NotAnIndexError

    d = workdir / "art"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "art.wal").write_bytes(image)
    try:
        open_index("art", str(d)).close()
    except (NotAnIndexError, WalError):
        pass  # refusing a damaged log is a correct outcome; what is timed is how long it takes to say so


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    rng = random.Random(SEED)
    rows: list[SummaryRow] = []
    raw: list[tuple] = []
    workdir = Path(tempfile.mkdtemp(prefix="qc-recovery-"))
    try:
        for n in cfg["records"]:
            damaged, clean = ssd_log_image(n, damage=True, rng=rng), ssd_log_image(n, damage=False, rng=rng)
            t_bad = _time(lambda: wal.scan_bytes(damaged, "bench", mode=ssd_log.SCAN_MODE), cfg["reps"])
            t_ok = _time(lambda: wal.scan_bytes(clean, "bench", mode=ssd_log.SCAN_MODE), cfg["reps"])
            rep, recs = wal.scan_bytes(damaged, "bench", mode=ssd_log.SCAN_MODE)
            mib = len(damaged) / 2**20
            raw += [("ssd_log_flip_every_second", n, len(damaged), "damaged", i, s) for i, s in enumerate(t_bad)]
            raw += [("ssd_log_flip_every_second", n, len(clean), "clean", i, s) for i, s in enumerate(t_ok)]
            sb, so = spread(t_bad), spread(t_ok)
            params = {"pattern": "ssd_log_flip_every_second", "records": n, "file_bytes": len(damaged)}
            rows.append(SummaryRow.from_spread(sb, metric="scan_s", subject="salvage scan, damaged", unit="s",
                                               baseline="salvage scan, clean log", baseline_value=so["median"],
                                               n=cfg["reps"], params=params,
                                               notes=f"{len(recs)} records recovered, "
                                                     f"{len(rep.damaged_lsns)} damaged ranges reported"))
            rows.append(SummaryRow(metric="scan_s_per_mib", subject="salvage scan, damaged", unit="s/MiB",
                                   value=sb["median"] / mib, n=cfg["reps"], params=params))
        for mib_n in cfg["mib"]:
            size = mib_n << 20
            fake, clean = fake_header_image(size, rng), clean_wal_image(size, rng)
            params = {"pattern": "wal_fake_headers", "file_bytes": size}
            for subject, fn, base_fn in (
                ("wal.scan, fake headers", lambda: _scan_quiet(fake), lambda: _scan_quiet(clean)),
                ("open_index('art'), fake headers", lambda: _open_art(fake, workdir), lambda: _scan_quiet(clean)),
            ):
                t_bad, t_ok = _time(fn, cfg["reps"]), _time(base_fn, cfg["reps"])
                raw += [("wal_fake_headers", subject, size, "damaged", i, s) for i, s in enumerate(t_bad)]
                raw += [("wal_fake_headers", subject, size, "clean", i, s) for i, s in enumerate(t_ok)]
                sb, so = spread(t_bad), spread(t_ok)
                rows.append(SummaryRow.from_spread(sb, metric="scan_s", subject=subject, unit="s",
                                                   baseline="wal.scan, clean log",
                                                   baseline_value=so["median"], n=cfg["reps"], params=params))
                rows.append(SummaryRow(metric="scan_s_per_mib", subject=subject, unit="s/MiB",
                                       value=sb["median"] / mib_n, n=cfg["reps"], params=params))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write_raw(NAME, "raw.csv", ["pattern", "size_param", "file_bytes", "image", "rep", "seconds"], raw, results_root)
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start)
    print_table(rows, title="recovery under damage")
    return rows


def _scan_quiet(image: bytes) -> None:
    try:
        wal.scan_bytes(image, "bench", mode="point_in_time")
    except wal.WalCorruptionError:
        pass  # refusing is a correct outcome; the time to decide is what is measured


def plot(results_root: str | None = None, out_dir: str | os.PathLike = "paper/figures") -> Path:
    """Time per MiB against file size for every damage pattern: flat lines mean linear recovery."""
    from experiments.plotstyle import PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    per = df[df["metric"] == "scan_s_per_mib"]
    fig, ax = figure(7.0, 3.4)
    for colour, (subject, part) in zip(PALETTE, per.groupby("subject", sort=False)):
        part = part.sort_values("file_bytes")
        ax.plot(part["file_bytes"] / 2**20, part["value"] * 1e3, marker="o", label=subject, color=colour)
    ax.set_xscale("log")
    ax.set_yscale("log")
    style_axes(ax, xlabel="log file size (MiB, log scale)", ylabel="ms per MiB scanned (log)",
               title="Recovery time per MiB under damage (flat = linear)")
    legend(ax)
    return save(fig, Path(out_dir) / "recovery.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
