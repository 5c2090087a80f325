"""Crash study of the SSD tier: real kills, simulated power loss, bit flips (issue 4, item 4).

Scenarios (every number below is counted, none assumed):

(a) ``kill_<layout>``: a child process (``experiments.crash_child``; real files in a temp dir on the
    local disk, real fsyncs) writes and acknowledges blocks through SsdTier and records each
    residency in an on-disk ART index; it prints every acknowledgement to a pipe. The parent keeps
    them in an expected-state file outside the store, SIGKILLs the child at a random moment,
    reopens tier + index, runs ``reconcile_index`` and checks: every acknowledged block present and
    bit-exact (content is derived from the key), no read returns wrong bytes, no index entry of the
    node points at a missing or different object. The same directory is reused across kills.
(b) ``powerloss_<layout>``: in-process, CrashFs: a random workload (put, put_many, put_async with
    callbacks, flush, delete) until power is lost at a random sync point; unsynced writes are
    kept, dropped, torn or garbled and unsynced directory operations lost; reopen and check the
    same properties (twice per trial: the recovered tier is written to and crashed again).
(c) ``bitflip_<target>_<layout>``: one random bit flipped in a stored object's bytes (object
    files: header or payload) or in a log record (slab layout); detection = recovery drops or
    reports it, or the read raises CorruptBlockError; wrong bytes served must be 0. Object flips
    are also run with ``verify_on_open=False`` so that the read path's check is what catches them.

Writes ``results/crash/summary.csv`` (+ ``raw.csv``: one row per crash/flip) and
``paper/figures/crash.png``. ``--quick``: >= 100 crashes, < 60 s; full: >= 1,000 crashes.
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
from pathlib import Path

from experiments.crash_child import NODE, block_content, block_key, open_tier
from experiments.microbench import bench_main
from quillcache.index import open_index
from quillcache.results import SummaryRow, results_dir, write_raw, write_summary
from quillcache.durability.crashfs import CrashFs, SimulatedCrash
from quillcache.store.errors import BlockNotFoundError, CorruptBlockError, StoreFullError
from quillcache.store.keys import StoreKey
from quillcache.store.reconcile import reconcile_index
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

NAME = "crash"
SEED = 20250401
QUICK = dict(kills=12, powerloss=60, bitflips=40)  # per layout
FULL = dict(kills=60, powerloss=500, bitflips=300)
RAW_HEADER = ["scenario", "trial", "acked_checked", "acked_lost", "corrupt_served", "dangling_before",
              "dangling_after", "recovered_blocks", "dropped_at_recovery", "flips", "flips_detected", "notes"]


# ------------------------------------------------------------------ (a) kill harness
def _read_lines(proc: subprocess.Popen, deadline: float, buf: bytearray) -> list[str]:
    """Lines from the child's stdout until ``deadline`` (or EOF)."""
    fd = proc.stdout.fileno()
    while True:
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


def _verify_real(tier: SsdTier, expected: dict[int, int], index) -> tuple[int, int, int, int, int]:
    """(acked_lost, corrupt_served, dangling_before, dangling_after, reconcile changes)."""
    live = tier.locations()
    lost = corrupt = 0
    for h, n in expected.items():
        k = block_key(h)
        try:
            if tier.get(k) != block_content(k, n):
                corrupt += 1
        except (BlockNotFoundError, CorruptBlockError):
            lost += 1
    for k in list(tier.keys()):
        try:
            data = tier.get(k)
        except CorruptBlockError:
            continue
        if data != block_content(k, len(data)):
            corrupt += 1
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


def run_kills(layout: str, kills: int, rng: random.Random, workdir: Path, raw: list) -> dict:
    tier_dir, index_dir = workdir / f"tier-{layout}", workdir / f"index-{layout}"
    expect_path = workdir / f"expected-{layout}.txt"
    expected: dict[int, int] = {}  # acknowledged and not asked to delete: must be present, bit-exact
    totals = dict(crashes=0, acked=0, lost=0, corrupt=0, dangling_before=0, dangling=0)
    first = 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(expect_path, "a") as expect_file:
        for trial in range(kills):
            proc = subprocess.Popen(
                [sys.executable, "-m", "experiments.crash_child", str(tier_dir), str(index_dir), layout,
                 str(rng.randrange(1 << 30)), str(first)], stdout=subprocess.PIPE, env=env)
            buf = bytearray()
            lines: list[str] = []
            # wait for "R", then let it run a random while
            while "R" not in lines and proc.poll() is None:
                lines += _read_lines(proc, time.monotonic() + 0.05, buf)
            lines += _read_lines(proc, time.monotonic() + rng.uniform(0.02, 0.6), buf)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            lines += _read_lines(proc, time.monotonic() + 1.0, buf)  # what reached the pipe before the kill
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
            lost, corrupt, before, after, _ = _verify_real(tier, expected, index)
            raw.append([f"kill_{layout}", trial, len(expected), lost, corrupt, before, after, len(tier),
                        len(tier.recovery.dropped), 0, 0, f"acks this run={sum(ln[:1] == 'A' for ln in lines)}"])
            totals["crashes"] += 1
            totals["acked"] += len(expected)
            totals["lost"] += lost
            totals["corrupt"] += corrupt
            totals["dangling_before"] += before
            totals["dangling"] += after
            index.close()
            tier.close()
    return totals


# ------------------------------------------------------------------ (b) simulated power loss
def _sim_workload(fs: CrashFs, layout: str, rng: random.Random, acked: dict, first: int, ops: int) -> None:
    t = SsdTier("/sim/t", capacity_bytes=2 << 20, fs=fs, layout=layout, slab_bytes=512 << 10,
                log_rotate_bytes=8 << 10, group_commit_blocks=4)
    nxt = first
    for _ in range(ops):
        r = rng.random()
        if r < 0.4:
            n = rng.randint(1, 60_000)
            try:
                t.put(block_key(nxt), block_content(block_key(nxt), n))
                acked[nxt] = n
            except StoreFullError:
                pass
            nxt += 1
        elif r < 0.55:
            items = {nxt + j: rng.randint(1, 20_000) for j in range(rng.randint(1, 5))}
            nxt += len(items)
            try:
                t.put_many([(block_key(i), block_content(block_key(i), n)) for i, n in items.items()])
                acked.update(items)
            except StoreFullError:
                pass
        elif r < 0.7:
            n = rng.randint(1, 20_000)

            def cb(k, err, n=n):
                if err is None:
                    acked[k.block_hash] = n
            try:
                t.put_async(block_key(nxt), block_content(block_key(nxt), n), cb)
            except StoreFullError:
                pass
            nxt += 1
        elif r < 0.9 and acked:
            i = rng.choice(sorted(acked))
            del acked[i]
            t.delete(block_key(i))
        else:
            t.flush()
    t.close()


def _sim_check(disk: CrashFs, layout: str, acked: dict) -> tuple[SsdTier, int, int]:
    t = SsdTier("/sim/t", capacity_bytes=2 << 20, fs=disk, layout=layout)
    lost = corrupt = 0
    for i, n in acked.items():
        try:
            if t.get(block_key(i)) != block_content(block_key(i), n):
                corrupt += 1
        except (BlockNotFoundError, CorruptBlockError):
            lost += 1
    for k in list(t.keys()):
        try:
            data = t.get(k)
        except CorruptBlockError:
            continue
        if data != block_content(k, len(data)):
            corrupt += 1
    return t, lost, corrupt


def run_powerloss(layout: str, trials: int, rng: random.Random, raw: list) -> dict:
    totals = dict(crashes=0, acked=0, lost=0, corrupt=0)
    for trial in range(trials):
        acked: dict[int, int] = {}
        fs = CrashFs(crash_at_sync=rng.randint(1, 300))
        first = 1
        for round_ in range(2):
            try:
                _sim_workload(fs, layout, rng, acked, first, ops=150)
            except SimulatedCrash:
                pass
            disk = fs.crash(rng)
            t, lost, corrupt = _sim_check(disk, layout, acked)
            cs = disk.last_crash
            raw.append([f"powerloss_{layout}", f"{trial}.{round_}", len(acked), lost, corrupt, 0, 0, len(t),
                        len(t.recovery.dropped), 0, 0,
                        f"sync={fs.sync_calls} writes kept/dropped/torn/garbled={cs.writes_kept}/{cs.writes_dropped}/"
                        f"{cs.writes_torn}/{cs.writes_garbled} dir ops kept/lost={cs.dir_ops_kept}/{cs.dir_ops_lost}"])
            totals["crashes"] += 1
            totals["acked"] += len(acked)
            totals["lost"] += lost
            totals["corrupt"] += corrupt
            del t  # power is lost again: the recovered instance is abandoned, not closed
            disk.crash_at_sync = disk.sync_calls + rng.randint(1, 150)
            fs, first = disk, 1_000_000
    return totals


# ------------------------------------------------------------------ (c) bit flips
def _bitflip_base(layout: str, rng: random.Random) -> tuple[CrashFs, dict[int, int]]:
    fs = CrashFs()
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
        t = SsdTier("/bf/t", capacity_bytes=4 << 20, fs=fs, verify_on_open=verify_on_open)
        rec = t.recovery
        detected = bool(rec.dropped or rec.log_damaged_lsns or rec.log_tail)
        corrupt = 0
        for k in list(t.keys()):
            try:
                if t.get(k) != block_content(k, t.size_of(k)):  # a flipped delete record may resurrect a block
                    corrupt += 1
            except CorruptBlockError:
                detected = detected or k in victims or not victims
        for k in victims:
            if k not in t and k in locs:
                detected = True  # dropped at recovery or on read
        t.close()
        totals["flips"] += 1
        totals["detected"] += int(detected)
        totals["corrupt"] += corrupt
        raw.append([f"bitflip_{target}_{layout}" + ("" if verify_on_open else "_lazy"), trial, 0, 0, corrupt, 0, 0,
                    len(t), len(rec.dropped), 1, int(detected), f"{path}@{pos}"])
    return totals


# ------------------------------------------------------------------ driver
def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    rng = random.Random(SEED)
    raw: list[list] = []
    rows: list[SummaryRow] = []
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="qc-crash-"))
    try:
        for layout in ("slab", "files"):
            tot = run_kills(layout, cfg["kills"], rng, workdir, raw)
            sub = f"kill_{layout}"
            note = f"SIGKILL of a child writing through SsdTier + ART index, real fsyncs; {tot['acked']} acked-block checks"
            rows += [SummaryRow(metric="crashes", subject=sub, value=tot["crashes"], unit="count", notes=note),
                     SummaryRow(metric="acknowledged_blocks_checked", subject=sub, value=tot["acked"], unit="blocks"),
                     SummaryRow(metric="acknowledged_blocks_lost", subject=sub, value=tot["lost"], unit="blocks",
                                notes="acceptance == 0: " + ("PASS" if tot["lost"] == 0 else "FAIL")),
                     SummaryRow(metric="corrupt_bytes_served", subject=sub, value=tot["corrupt"], unit="reads",
                                notes="acceptance == 0: " + ("PASS" if tot["corrupt"] == 0 else "FAIL")),
                     SummaryRow(metric="dangling_index_entries_before_reconcile", subject=sub,
                                value=tot["dangling_before"], unit="entries",
                                notes="index entries pointing at missing/different bytes right after reopen"),
                     SummaryRow(metric="dangling_index_entries", subject=sub, value=tot["dangling"], unit="entries",
                                notes="after reconcile_index; acceptance == 0: " + ("PASS" if tot["dangling"] == 0 else "FAIL"))]
        for layout in ("slab", "files"):
            tot = run_powerloss(layout, cfg["powerloss"], rng, raw)
            sub = f"powerloss_{layout}"
            rows += [SummaryRow(metric="crashes", subject=sub, value=tot["crashes"], unit="count",
                                notes="CrashFs power loss at a random sync point, 2 per trial"),
                     SummaryRow(metric="acknowledged_blocks_checked", subject=sub, value=tot["acked"], unit="blocks"),
                     SummaryRow(metric="acknowledged_blocks_lost", subject=sub, value=tot["lost"], unit="blocks",
                                notes="acceptance == 0: " + ("PASS" if tot["lost"] == 0 else "FAIL")),
                     SummaryRow(metric="corrupt_bytes_served", subject=sub, value=tot["corrupt"], unit="reads",
                                notes="acceptance == 0: " + ("PASS" if tot["corrupt"] == 0 else "FAIL"))]
        cases = [("object", "slab", True), ("object", "slab", False), ("log", "slab", True),
                 ("object", "files", True), ("object", "files", False)]
        for target, layout, verify in cases:
            tot = run_bitflips(layout, target, verify, cfg["bitflips"], rng, raw)
            sub = f"bitflip_{target}_{layout}" + ("" if verify else "_lazy")
            rate = tot["detected"] / tot["flips"]
            rows += [SummaryRow(metric="bitflips_injected", subject=sub, value=tot["flips"], unit="flips"),
                     SummaryRow(metric="bitflips_detected", subject=sub, value=tot["detected"], unit="flips",
                                baseline="bitflips_injected", baseline_value=tot["flips"],
                                notes=f"detection rate {rate:.3f}; acceptance 100%: {'PASS' if rate == 1 else 'FAIL'}"),
                     SummaryRow(metric="corrupt_bytes_served", subject=sub, value=tot["corrupt"], unit="reads",
                                notes="acceptance == 0: " + ("PASS" if tot["corrupt"] == 0 else "FAIL"))]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    total_crashes = sum(r.value for r in rows if r.metric == "crashes")
    rows.append(SummaryRow(metric="crashes", subject="all", value=total_crashes, unit="count",
                           notes=f"{'quick' if quick else 'full'} mode, {time.monotonic() - t_start:.0f} s"))
    write_raw(NAME, "raw.csv", RAW_HEADER, raw, root=results_root)
    write_summary(NAME, rows, root=results_root)
    _figure(rows, results_dir(NAME, results_root) if results_root else Path("paper/figures"))
    _print_table(rows)
    return rows


def plot(results_root: str | Path | None = None, out_dir: str | Path = "paper/figures") -> Path:
    """Redraw ``crash.png`` from ``results/crash/summary.csv`` (what ``make figures`` calls)."""
    import pandas as pd

    df = pd.read_csv(results_dir(NAME, results_root) / "summary.csv")
    rows = [SummaryRow(metric=r.metric, subject=r.subject, value=float(r.value), unit=r.unit) for r in df.itertuples()]
    return _figure(rows, Path(out_dir))


def _figure(rows: list[SummaryRow], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    subs = [r.subject for r in rows if r.metric == "crashes" and r.subject != "all"]
    get = {(r.metric, r.subject): r.value for r in rows}
    x = range(len(subs))
    a1.bar([i - 0.2 for i in x], [get[("acknowledged_blocks_checked", s)] for s in subs], 0.4, label="acked blocks checked")
    a1.bar([i + 0.2 for i in x], [get[("crashes", s)] for s in subs], 0.4, label="crashes")
    for i, s in enumerate(subs):
        lost, bad = get[("acknowledged_blocks_lost", s)], get[("corrupt_bytes_served", s)]
        a1.annotate(f"lost {lost:g}\nbad {bad:g}", (i, get[("acknowledged_blocks_checked", s)] * 1.3), ha="center", va="bottom", fontsize=8)
    a1.set_yscale("log")
    a1.set_ylim(top=max(get[("acknowledged_blocks_checked", s)] for s in subs) * 20)
    a1.set_xticks(list(x), subs, rotation=20, fontsize=8)
    a1.set_title("crashes: acknowledged blocks lost / corrupt reads")
    a1.legend(fontsize=8)
    fsubs = [r.subject for r in rows if r.metric == "bitflips_injected"]
    rates = [get[("bitflips_detected", s)] / get[("bitflips_injected", s)] for s in fsubs]
    a2.bar(range(len(fsubs)), rates, color="tab:green")
    a2.set_ylim(0, 1.05)
    a2.set_xticks(range(len(fsubs)), fsubs, rotation=20, fontsize=8)
    a2.set_title("bit flips detected (fraction)")
    fig.tight_layout()
    path = out / "crash.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _print_table(rows: list[SummaryRow]) -> None:
    print(f"{'metric':<42} {'subject':<26} {'value':>10}  notes")
    for r in rows:
        print(f"{r.metric:<42} {r.subject:<26} {r.value:>10g}  {r.notes}")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
