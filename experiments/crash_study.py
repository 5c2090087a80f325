"""Crash study of the SSD tier and its ART index: real kills, simulated power loss, bit flips.

Scenarios (every number below is counted, none assumed):

(a) ``kill_<layout>``: a child process (``experiments.crash_child``; real files in a temp dir on the
    local disk, real fsyncs) writes and acknowledges blocks through SsdTier and records each
    residency in an on-disk ART index; it prints every acknowledgement to a pipe. The parent keeps
    them in an expected-state file outside the store, SIGKILLs the child once it has seen N
    acknowledgements (N drawn from the seeded RNG; a deadline bounds the wait), reopens tier +
    index, runs ``reconcile_index`` and checks: every acknowledged block present and bit-exact
    (content is derived from the key), no read returns wrong bytes, no index entry of the node
    points at a missing or different object. The same directory is reused across kills.
(b) ``powerloss_<layout>``: in-process, CrashFs: a random workload
    (:func:`experiments.crash_workload.tier_workload`: put, put_many, put_async with callbacks,
    flush, delete) until power is lost at a sync point drawn from the seeded RNG
    (``CrashFs(crash_at_sync=n)``); ``crash(rng, zero_fill=True)`` then keeps, drops, tears, garbles
    or zeroes each unsynced write and loses a random suffix of the unsynced directory operations; reopen and check the
    same properties (twice per trial: the recovered tier is written to and crashed again).
(c) ``powerloss_index_<layout>``: the same power losses with the SSD tier AND an on-disk ART index
    on ONE CrashFs (:func:`experiments.crash_workload.tier_index_workload`: bytes durable, then the
    index entry; on delete the entry removed and flushed first; small index checkpoint thresholds
    so that crashes also land inside index checkpoints). Reopen both on the surviving disk and
    count acknowledged blocks lost, wrong bytes served and acknowledged index entries lost; then
    ``reconcile_index`` and count dangling index entries (an entry of this node whose block the
    tier does not hold at that location). Twice per trial, like (b).
(d) ``bitflip_<target>_<layout>``: one random bit flipped in a stored object's bytes (object
    files: header or payload) or in a log record (slab layout); detection = recovery drops or
    reports it, or the read raises CorruptBlockError; wrong bytes served must be 0. Object flips
    are also run with ``verify_on_open=False`` so that the read path's check is what catches them.

Writes ``results/crash/summary.csv`` (+ ``raw.csv``: one row per crash/flip) and
``paper/figures/crash.png``. ``--quick``: a few dozen trials per scenario (run by the tests);
full: >= 1,000 power-loss trials of the tier alone and >= 1,000 of tier + index.
"""

from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from experiments.crash_child import open_tier
from experiments.crash_workload import (
    NODE,
    STUDY_SHAPE,
    IndexModel,
    block_content,
    block_key,
    check_tier,
    check_tier_index,
    forget_faults,
    tier_faults,
    tier_index_workload,
    tier_workload,
)
from experiments.microbench import bench_main
from quillcache.durability.crashfs import CrashFs, SimulatedCrash
from quillcache.index import open_index
from quillcache.results import SummaryRow, print_table, write_raw, write_summary
from quillcache.store.errors import CorruptBlockError, SsdLogMissingError
from quillcache.store.keys import StoreKey
from quillcache.store.reconcile import reconcile_index
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

NAME = "crash"
SEED = 20250401
# per layout; every power-loss trial is two power losses (the recovered state is powered off again); one whose
# drawn sync point the workload never reached strikes after its clean close and is counted apart from crashes
PROGRESS_METRICS = ("crashes", "acknowledged_blocks_checked", "acknowledged_blocks_lost", "bitflips_injected",
                    "bitflips_detected", "corrupt_bytes_served")
QUICK = dict(kills=2, max_acks=60, powerloss=10, powerloss_index=20, bitflips=10)
FULL = dict(kills=60, max_acks=400, powerloss=500, powerloss_index=500, bitflips=300)
KILL_DEADLINE_S = 60.0  # longest wait for a child to reach its N acknowledgements
RAW_HEADER = ["scenario", "trial", "acked_checked", "acked_lost", "corrupt_served", "dangling_before",
              "dangling_after", "recovered_blocks", "dropped_at_recovery", "flips", "flips_detected",
              "index_acked_lost", "notes"]


# ------------------------------------------------------------------ (a) kill harness
def _read_lines(proc: subprocess.Popen, deadline: float, buf: bytearray) -> list[str]:
    """The complete lines the child wrote, waiting until some arrive, ``deadline`` or EOF."""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
    *lines, rest = buf.split(b"\n")
    buf[:] = rest
    return [ln.decode() for ln in lines]


def _drain(proc: subprocess.Popen, buf: bytearray) -> list[str]:
    """Every line left in the pipe of a dead child (up to EOF)."""
    rest = proc.stdout.read()
    buf += rest or b""
    *lines, tail = buf.split(b"\n")
    buf[:] = tail
    return [ln.decode() for ln in lines]


def _kill_after_acks(proc: subprocess.Popen, acks: int, deadline_s: float) -> tuple[list[str], bool]:
    """SIGKILL the child once ``acks`` acknowledgement lines arrived (or at the deadline):
    ``(every line it wrote, whether the count was reached)``."""
    buf = bytearray()
    lines: list[str] = []
    seen = 0
    deadline = time.monotonic() + deadline_s
    while seen < acks and time.monotonic() < deadline and proc.poll() is None:
        new = _read_lines(proc, deadline, buf)
        seen += sum(ln[:1] == "A" for ln in new)
        lines += new
    exited = proc.poll()
    if exited is not None and seen < acks:
        # the child died on its own (an exception, a crash): this trial tested nothing, so the
        # study fails loudly instead of counting it as a kill
        raise RuntimeError(f"crash child exited with status {exited} after {seen} of {acks} acknowledgements "
                           "before it was killed (its traceback is on stderr above)")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines += _drain(proc, buf)  # what reached the pipe before the kill
    return lines, seen >= acks


def _verify_real(tier: SsdTier, expected: dict[int, int], index,
                 known: set[StoreKey]) -> tuple[int, int, int, int, int]:
    """(acked_lost, corrupt_served, dangling_before, dangling_after, reconcile changes); the blocks
    found lost or wrong are counted once (:func:`~experiments.crash_workload.forget_faults`)."""
    faults = tier_faults(tier, expected, known)
    forget_faults(faults, expected, known)
    lost, corrupt = len(faults.lost), len(faults.corrupt)
    live = tier.locations()

    def dangling() -> int:
        bad = 0
        for e in index.entries_on_node(NODE):
            if e.tier == CacheTier.SSD and live.get(StoreKey(e.block_hash, e.identity)) != (
                    e.segment_id, e.offset_bytes, e.size_bytes):
                bad += 1
        return bad

    before = dangling()
    rep = reconcile_index(index, NODE, CacheTier.SSD, live)
    return lost, corrupt, before, dangling(), rep.changed


def run_kills(layout: str, kills: int, max_acks: int, rng: random.Random, workdir: Path, raw: list) -> dict:
    tier_dir, index_dir = workdir / f"tier-{layout}", workdir / f"index-{layout}"
    expect_path = workdir / f"expected-{layout}.txt"
    expected: dict[int, int] = {}  # acknowledged and not asked to delete: must be present, bit-exact
    known: set[StoreKey] = set()  # wrong reads already counted
    totals = dict(crashes=0, acked=0, lost=0, corrupt=0, dangling_before=0, dangling=0, short=0)
    first = 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(expect_path, "a") as expect_file:
        for trial in range(kills):
            acks = rng.randint(1, max_acks)
            proc = subprocess.Popen(
                [sys.executable, "-m", "experiments.crash_child", str(tier_dir), str(index_dir), layout,
                 str(rng.randrange(1 << 30)), str(first)], stdout=subprocess.PIPE, env=env)
            lines, reached = _kill_after_acks(proc, acks, KILL_DEADLINE_S)
            totals["short"] += int(not reached)
            for ln in lines:
                parts = ln.split()
                if parts and parts[0] == "A":
                    expected[int(parts[1])] = int(parts[2])
                    first = max(first, int(parts[1]) + 1)
                elif parts and parts[0] == "D":
                    expected.pop(int(parts[1]), None)
                if parts and parts[0] in "AD":
                    expect_file.write(ln + "\n")
            expect_file.flush()
            os.fsync(expect_file.fileno())
            first += 1000  # the child may have used keys it never acknowledged
            tier = open_tier(str(tier_dir))
            index = open_index("art", index_dir)
            checked = len(expected)
            lost, corrupt, before, after, _ = _verify_real(tier, expected, index, known)
            raw.append([f"kill_{layout}", trial, checked, lost, corrupt, before, after, len(tier),
                        len(tier.recovery.dropped), 0, 0, 0,
                        f"killed after {acks} acks{'' if reached else ' (deadline hit first)'}; "
                        f"acks this run={sum(ln[:1] == 'A' for ln in lines)}"])
            totals["crashes"] += 1
            totals["acked"] += checked
            totals["lost"] += lost
            totals["corrupt"] += corrupt
            totals["dangling_before"] += before
            totals["dangling"] += after
            index.close()
            tier.close()
    return totals


# ------------------------------------------------------------------ (b) simulated power loss
# A power loss may also leave an unsynced write's range as zero bytes (ext4/XFS: the size was extended, the data
# blocks never written): CrashFs's fifth fate, drawn in (b) and (c) beside kept, dropped, torn and garbled.
ZERO_FILL = True


def _crash_notes(fs: CrashFs, disk: CrashFs) -> str:
    cs = disk.last_crash
    # sync = the sync calls the workload made, crash_at = the drawn power-loss point: a power loss that
    # interrupted the workload struck at sync == crash_at, one after a clean close has sync < crash_at
    return (f"sync={fs.sync_calls} crash_at={fs.crash_at_sync} writes kept/dropped/torn/garbled/zeroed="
            f"{cs.writes_kept}/{cs.writes_dropped}/{cs.writes_torn}/{cs.writes_garbled}/{cs.writes_zeroed} "
            f"dir ops kept/lost={cs.dir_ops_kept}/{cs.dir_ops_lost}")


def _when(interrupted: bool) -> str:
    """A power loss whose drawn sync point the workload never reached struck after its clean ``close``:
    still checked (nothing acknowledged may be lost), but not counted as a crash of the workload."""
    return "mid-workload:" if interrupted else "after clean close:"


def run_powerloss(layout: str, trials: int, rng: random.Random, raw: list) -> dict:
    totals = dict(crashes=0, after_close=0, acked=0, lost=0, corrupt=0)
    for trial in range(trials):
        acked: dict[int, int] = {}
        known: set[StoreKey] = set()  # wrong reads already counted in this trial
        fs = CrashFs(crash_at_sync=rng.randint(1, 300))
        first = 1
        for round_ in range(2):
            interrupted = False
            try:
                tier_workload(fs, layout, rng, acked, 150, STUDY_SHAPE, directory="/sim/t", first=first)
            except SimulatedCrash:
                interrupted = True
            disk = fs.crash(rng, zero_fill=ZERO_FILL)
            checked = len(acked)
            # what it finds lost or wrong leaves `acked`: counted once, never deleted by the next round
            t, lost, corrupt = check_tier(disk, layout, acked, STUDY_SHAPE, directory="/sim/t", known=known)
            raw.append([f"powerloss_{layout}", f"{trial}.{round_}", checked, lost, corrupt, 0, 0, len(t),
                        len(t.recovery.dropped), 0, 0, 0, f"{_when(interrupted)} {_crash_notes(fs, disk)}"])
            totals["crashes" if interrupted else "after_close"] += 1
            totals["acked"] += checked
            totals["lost"] += lost
            totals["corrupt"] += corrupt
            del t  # power is lost again: the recovered instance is abandoned, not closed
            disk.crash_at_sync = disk.sync_calls + rng.randint(1, 150)
            fs, first = disk, 1_000_000
    return totals


# ------------------------------------------------------------------ (c) power loss, tier + index
def run_powerloss_index(layout: str, trials: int, rng: random.Random, raw: list) -> dict:
    totals = dict(crashes=0, after_close=0, acked=0, lost=0, corrupt=0, index_acked=0, index_lost=0,
                  dangling_before=0, dangling=0, unindexed=0)
    for trial in range(trials):
        model = IndexModel()
        fs = CrashFs(crash_at_sync=rng.randint(1, 300))
        for round_ in range(2):
            interrupted = False
            try:
                tier_index_workload(fs, layout, rng, model, 100, STUDY_SHAPE, root="/sim")
            except SimulatedCrash:
                interrupted = True
            disk = fs.crash(rng, zero_fill=ZERO_FILL)
            acked, index_acked = len(model.acked), len(model.index_acked)
            t, ix, c = check_tier_index(disk, layout, model, STUDY_SHAPE, root="/sim")
            raw.append([f"powerloss_index_{layout}", f"{trial}.{round_}", acked, c.acked_lost, c.corrupt_served,
                        c.dangling_before, c.dangling_after, c.recovered_blocks, c.dropped_at_recovery, 0, 0,
                        c.index_acked_lost,
                        f"{_when(interrupted)} {_crash_notes(fs, disk)} index entries acked={index_acked} "
                        f"reconcile changes={c.reconcile_changes} unindexed after={c.unindexed_after}"])
            totals["crashes" if interrupted else "after_close"] += 1
            totals["acked"] += acked
            totals["lost"] += c.acked_lost
            totals["corrupt"] += c.corrupt_served
            totals["index_acked"] += index_acked
            totals["index_lost"] += c.index_acked_lost
            totals["dangling_before"] += c.dangling_before
            totals["dangling"] += c.dangling_after
            totals["unindexed"] += c.unindexed_after
            del t, ix  # power is lost again: the recovered instances are abandoned, not closed
            disk.crash_at_sync = disk.sync_calls + rng.randint(1, 150)
            fs = disk
    return totals


# ------------------------------------------------------------------ (d) bit flips
def _bitflip_base(layout: str, rng: random.Random) -> tuple[CrashFs, dict[int, int]]:
    fs = CrashFs()
    fs.mkdir("/bf")
    t = SsdTier("/bf/t", capacity_bytes=4 << 20, fs=fs, layout=layout, slab_bytes=1 << 20, log_rotate_bytes=1 << 20)
    sizes: dict[int, int] = {}
    for i in range(1, 41):
        sizes[i] = rng.randint(100, 40_000)
        if rng.random() < 0.5:
            t.put(block_key(i), block_content(block_key(i), sizes[i]))
        else:
            t.put_many([(block_key(i), block_content(block_key(i), sizes[i]))])
    for i in rng.sample(sorted(sizes), 8):
        t.delete(block_key(i))
        del sizes[i]
    t.close()
    return fs, sizes


def run_bitflips(layout: str, target: str, verify_on_open: bool, trials: int, rng: random.Random, raw: list) -> dict:
    base, sizes = _bitflip_base(layout, rng)
    probe = SsdTier("/bf/t", capacity_bytes=4 << 20, fs=base.snapshot())
    locs = probe.locations()
    probe.close()
    from quillcache.store.ssd_files import HEADER_BYTES
    totals = dict(flips=0, detected=0, corrupt=0)
    log_path = next((p for p in base.paths("/bf/t") if p.endswith(".qcl")), None)
    for trial in range(trials):
        fs = base.snapshot()
        if target == "object":
            k = rng.choice(sorted(locs, key=lambda k: k.block_hash))
            seg, off, size = locs[k]
            if layout == "slab":
                path, pos = f"/bf/t/slab-{seg:05d}.qcs", off + rng.randrange(size)
            else:
                path, pos = f"/bf/t/o-{seg:08x}.qco", rng.randrange(HEADER_BYTES + size)
            victims = {k}
        else:  # a log record (anything after the 32-byte header)
            path = log_path
            pos = 32 + rng.randrange(fs.stat(path).size_bytes - 32)
            victims = set()
        fs.corrupt(path, pos, 1 << rng.randrange(8))
        subject = f"bitflip_{target}_{layout}" + ("" if verify_on_open else "_lazy")
        try:
            t = SsdTier("/bf/t", capacity_bytes=4 << 20, fs=fs, verify_on_open=verify_on_open)
        except SsdLogMissingError:
            # the flip made the log unusable: the tier refuses to open (serving nothing, keeping the
            # evidence) instead of starting empty; that is a detection
            t, note = None, "; refused to open (log unusable)"
        corrupt, served, dropped = 0, 0, 0
        if t is None:
            detected = True
        else:
            note = ""
            detected = not t.recovery.clean  # anything dropped, quarantined, skipped or cut short
            dropped = len(t.recovery.dropped)
            for k in list(t.keys()):
                try:
                    if t.get(k) != block_content(k, t.size_of(k)):  # a flipped delete record may resurrect a block
                        corrupt += 1
                except CorruptBlockError:
                    detected = detected or k in victims or not victims
            for k in victims:
                if k not in t and k in locs:
                    detected = True  # dropped at recovery or on read
            served = len(t)
            t.close()
        totals["flips"] += 1
        totals["detected"] += int(detected)
        totals["corrupt"] += corrupt
        raw.append([subject, trial, 0, 0, corrupt, 0, 0, served, dropped, 1, int(detected), 0, f"{path}@{pos}{note}"])
    return totals


# ------------------------------------------------------------------ driver
def _zero(value: int, what: str = "") -> str:
    return f"{what}acceptance == 0: " + ("PASS" if value == 0 else "FAIL")


def _powerloss_rows(sub: str, trials: int, tot: dict, note: str) -> list[SummaryRow]:
    return [SummaryRow(metric="crashes", subject=sub, value=tot["crashes"], unit="count",
                       notes=f"{note}; only power losses that interrupted the workload"),
            SummaryRow(metric="power_losses_after_clean_close", subject=sub, value=tot["after_close"],
                       unit="count", notes="the drawn sync point came after the workload closed cleanly; "
                                           "checked like the others, not counted as crashes"),
            SummaryRow(metric="trials", subject=sub, value=trials, unit="count",
                       notes="one trial = a power loss, recovery, more writes, a second power loss"),
            SummaryRow(metric="acknowledged_blocks_checked", subject=sub, value=tot["acked"], unit="checks"),
            SummaryRow(metric="acknowledged_blocks_lost", subject=sub, value=tot["lost"], unit="blocks",
                       notes=_zero(tot["lost"])),
            SummaryRow(metric="corrupt_bytes_served", subject=sub, value=tot["corrupt"], unit="reads",
                       notes=_zero(tot["corrupt"]))]


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = dict(QUICK if quick else FULL)
    rng = random.Random(SEED)
    raw: list[list] = []
    rows: list[SummaryRow] = []
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="qc-crash-"))
    try:
        for layout in ("slab", "files"):
            tot = run_kills(layout, cfg["kills"], cfg["max_acks"], rng, workdir, raw)
            sub = f"kill_{layout}"
            mark = len(rows)
            note = (f"SIGKILL of a child writing through SsdTier + ART index after N acks (N seeded, "
                    f"1..{cfg['max_acks']}; {tot['short']} hit the deadline first), real fsyncs; "
                    f"{tot['acked']} acked-block checks")
            rows += [SummaryRow(metric="crashes", subject=sub, value=tot["crashes"], unit="count", notes=note),
                     SummaryRow(metric="acknowledged_blocks_checked", subject=sub, value=tot["acked"], unit="checks"),
                     SummaryRow(metric="acknowledged_blocks_lost", subject=sub, value=tot["lost"], unit="blocks",
                                notes="acceptance == 0: " + ("PASS" if tot["lost"] == 0 else "FAIL")),
                     SummaryRow(metric="corrupt_bytes_served", subject=sub, value=tot["corrupt"], unit="reads",
                                notes="acceptance == 0: " + ("PASS" if tot["corrupt"] == 0 else "FAIL")),
                     SummaryRow(metric="dangling_index_entries_before_reconcile", subject=sub,
                                value=tot["dangling_before"], unit="entries",
                                notes="index entries pointing at missing/different bytes right after reopen"),
                     SummaryRow(metric="dangling_index_entries", subject=sub, value=tot["dangling"], unit="entries",
                                notes="after reconcile_index; acceptance == 0: " + ("PASS" if tot["dangling"] == 0 else "FAIL"))]
            _tag(rows, mark, scenario="kill", layout=layout)
        for layout in ("slab", "files"):
            tot = run_powerloss(layout, cfg["powerloss"], rng, raw)
            mark = len(rows)
            rows += _powerloss_rows(f"powerloss_{layout}", cfg["powerloss"], tot,
                                    "CrashFs power loss at a seeded sync point, 2 power losses per trial")
            _tag(rows, mark, scenario="powerloss", layout=layout)
        for layout in ("slab", "files"):
            tot = run_powerloss_index(layout, cfg["powerloss_index"], rng, raw)
            sub = f"powerloss_index_{layout}"
            mark = len(rows)
            rows += _powerloss_rows(sub, cfg["powerloss_index"], tot,
                                    "SSD tier + ART index on one CrashFs, power loss at a seeded sync point, "
                                    "2 power losses per trial")
            rows += [SummaryRow(metric="acknowledged_index_entries_checked", subject=sub, value=tot["index_acked"],
                                unit="checks"),
                     SummaryRow(metric="acknowledged_index_entries_lost", subject=sub, value=tot["index_lost"],
                                unit="entries", notes=_zero(tot["index_lost"], "flushed entries missing after reopen; ")),
                     SummaryRow(metric="dangling_index_entries_before_reconcile", subject=sub,
                                value=tot["dangling_before"], unit="entries",
                                notes="index entries pointing at missing/different bytes right after reopen"),
                     SummaryRow(metric="dangling_index_entries", subject=sub, value=tot["dangling"], unit="entries",
                                notes=_zero(tot["dangling"], "after reconcile_index; ")),
                     SummaryRow(metric="unindexed_blocks_after_reconcile", subject=sub, value=tot["unindexed"],
                                unit="blocks", notes=_zero(tot["unindexed"], "tier blocks without their entry; "))]
            _tag(rows, mark, scenario="powerloss_index", layout=layout)
        cases = [("object", "slab", True), ("object", "slab", False), ("log", "slab", True),
                 ("object", "files", True), ("object", "files", False)]
        for target, layout, verify in cases:
            tot = run_bitflips(layout, target, verify, cfg["bitflips"], rng, raw)
            sub = f"bitflip_{target}_{layout}" + ("" if verify else "_lazy")
            rate = tot["detected"] / tot["flips"]
            mark = len(rows)
            rows += [SummaryRow(metric="bitflips_injected", subject=sub, value=tot["flips"], unit="flips"),
                     SummaryRow(metric="bitflips_detected", subject=sub, value=tot["detected"], unit="flips"),
                     SummaryRow(metric="detection_rate", subject=sub, value=rate, unit="fraction of flips",
                                notes=f"acceptance 100%: {'PASS' if rate == 1 else 'FAIL'}"),
                     SummaryRow(metric="corrupt_bytes_served", subject=sub, value=tot["corrupt"], unit="reads",
                                notes="acceptance == 0: " + ("PASS" if tot["corrupt"] == 0 else "FAIL"))]
            _tag(rows, mark, scenario="bitflip", layout=layout, flip_target=target, verify_on_open=verify)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_crashes = sum(r.value for r in rows if r.metric == "crashes")
    rows.append(SummaryRow(metric="crashes", subject="all", value=total_crashes, unit="count",
                           notes=f"{'quick' if quick else 'full'} profile", params={"scenario": "all"}))
    for metric, unit in (("power_losses_after_clean_close", "count"),
                         ("acknowledged_blocks_checked", "checks"), ("acknowledged_index_entries_checked", "checks"),
                         ("acknowledged_blocks_lost", "blocks"), ("acknowledged_index_entries_lost", "entries"),
                         ("corrupt_bytes_served", "reads"), ("dangling_index_entries", "entries"),
                         ("bitflips_injected", "flips"), ("bitflips_detected", "flips")):
        rows.append(SummaryRow(metric=metric, subject="all", unit=unit, params={"scenario": "all"},
                               value=sum(r.value for r in rows if r.metric == metric and r.subject != "all")))
    write_raw(NAME, "raw.csv", RAW_HEADER, raw, root=results_root)
    write_summary(NAME, rows, root=results_root, profile="quick" if quick else "full", started_at=t_start)
    print_table(rows, title="crash study")
    return rows


def _tag(rows: list[SummaryRow], start: int, **params) -> None:
    """Give rows[start:] the scenario's parameters as typed columns, and say how the scenario went."""
    rows[start:] = [replace(r, params={**r.params, **params}) for r in rows[start:]]
    done = {r.metric: r.value for r in rows[start:]}
    print(f"[crash] {rows[start].subject}: " + ", ".join(
        f"{k.replace('_', ' ')} {v:g}" for k, v in done.items() if k in PROGRESS_METRICS), flush=True)


def plot(results_root: str | Path | None = None, out_dir: str | Path = "paper/figures") -> Path:
    """``crash.png`` from the summary only: per scenario the acknowledged blocks checked and the
    crashes behind them, with what was lost or served corrupt written on each bar; and the share
    of injected bit flips detected."""
    import numpy as np

    from experiments.plotstyle import BASELINE, OURS, PALETTE, figure, legend, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    df = df[df["subject"] != "all"]
    get = {(m, s): float(v) for m, s, v in zip(df["metric"], df["subject"], df["value"])}
    subs = [s for m, s in get if m == "crashes"]
    fig, (a1, a2) = figure(10.0, 3.8, 1, 2, width_ratios=[3, 2])
    x = np.arange(len(subs))
    checked = [get[("acknowledged_blocks_checked", s)] for s in subs]
    a1.bar(x - 0.2, checked, 0.4, label="acknowledged blocks checked", color=OURS)
    a1.bar(x + 0.2, [get[("crashes", s)] for s in subs], 0.4, label="crashes", color=BASELINE)
    for i, s in enumerate(subs):
        a1.annotate(f"lost {get[('acknowledged_blocks_lost', s)]:g}\ncorrupt {get[('corrupt_bytes_served', s)]:g}",
                    (i, checked[i] * 1.3), ha="center", va="bottom", fontsize=7)
    a1.set_yscale("log")
    a1.set_ylim(top=max(checked) * 30)
    a1.set_xticks(x)
    a1.set_xticklabels([s.replace("_", "\n", 1) for s in subs], fontsize=7)
    style_axes(a1, ylabel="count (log scale)", title="Crashes: acknowledged blocks lost or corrupt")
    legend(a1, loc="upper left", ncol=2)
    fsubs = [s for m, s in get if m == "bitflips_injected"]
    rates = [get[("bitflips_detected", s)] / get[("bitflips_injected", s)] for s in fsubs]
    a2.barh(np.arange(len(fsubs)), rates, 0.6, color=PALETTE[2])
    for i, s in enumerate(fsubs):
        a2.annotate(f"{get[('bitflips_detected', s)]:g} / {get[('bitflips_injected', s)]:g}", (rates[i], i),
                    ha="right", va="center", fontsize=7, color="white")
    a2.set_yticks(np.arange(len(fsubs)))
    a2.set_yticklabels([s.removeprefix("bitflip_") for s in fsubs], fontsize=7)
    a2.set_xlim(0, 1.0)
    style_axes(a2, xlabel="share of injected flips detected", title="Bit flips detected (higher is better)")
    return save(fig, Path(out_dir) / "crash.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
