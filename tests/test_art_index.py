"""Persistent ART index: crash recovery yields exactly the acknowledged batches; damage is refused."""

from __future__ import annotations

import os
import random
import select
import signal
import struct
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.index import open_index
from quillcache.index.art_index import CHECKPOINT, WAL, IndexCorruptionError
from quillcache.index.keys import ResidencyEntry
from quillcache.types import CacheTier


def entry(h: int, node: str = "n0", tier: CacheTier = CacheTier.DRAM, off: int = 0) -> ResidencyEntry:
    return ResidencyEntry(h, node, tier, h.to_bytes(16, "little"), 1, off, 4096)


def snapshot(ix) -> list:
    return ix.scan_prefix(b"")


def test_crash_after_flush_keeps_exactly_the_flushed_state(tmp_path):
    rng = random.Random(1)
    ix = open_index("art", tmp_path / "a")
    acked = None
    for step in range(300):
        h = rng.randrange(2000)
        if rng.random() < 0.7:
            ix.put([entry(h, f"n{rng.randrange(3)}", CacheTier(rng.randrange(3)), rng.randrange(10**6))])
        else:
            ix.remove([entry(h, f"n{rng.randrange(3)}", CacheTier(rng.randrange(3)))])
        if step % 37 == 0:
            ix.flush()
            acked = snapshot(ix)
    # crash: abandon the object (unflushed batches are still in the user-space group buffer)
    del ix
    ix = open_index("art", tmp_path / "a")
    assert snapshot(ix) == acked
    ix.close()


@given(cut=st.integers(0, 100_000), seed=st.integers(0, 2**31), mode=st.sampled_from(["cut", "flip", "garbage"]))
@settings(max_examples=40, deadline=None)
def test_damage_after_the_durable_point_yields_exactly_the_acknowledged(tmp_path_factory, cut, seed, mode):
    d = tmp_path_factory.mktemp("art") / "ix"
    ix = open_index("art", d)
    ix.put([entry(h) for h in range(50)])
    ix.flush()
    ix.checkpoint()  # checkpoint + fresh WAL
    ix.put([entry(h, "n1") for h in range(50, 80)])
    ix.remove([entry(3)])
    ix.flush()
    acked = snapshot(ix)
    durable = (d / WAL).stat().st_size
    ix._wal.group_bytes = 1  # make later appends reach the file (unsynced)
    for j in range(5):
        ix.put([entry(1000 + j * 10 + i, "n2") for i in range(10)])
    del ix
    data = bytearray((d / WAL).read_bytes())
    tail = len(data) - durable
    rng = random.Random(seed)
    if mode == "cut":
        data = data[: durable + cut % (tail + 1)]
    elif mode == "flip":
        data[durable + cut % tail] ^= 1 + rng.randrange(255)
    else:
        data = data[:durable] + rng.randbytes(cut % 500)
    (d / WAL).write_bytes(bytes(data))
    ix = open_index("art", d)
    got = snapshot(ix)
    # every acknowledged record is there, and anything more is whole unacknowledged batches, in order
    extra = [kv for kv in got if kv not in acked]
    assert [kv for kv in got if kv in acked] == acked
    extra_primary = [k for k, _ in extra if k[:1] == b"B"]
    assert len(extra_primary) % 10 == 0  # whole batches of 10 entries only
    if mode == "garbage" or (mode == "cut" and cut % (tail + 1) == 0):
        assert got == acked
    ix.close()


def _built(tmp_path):
    d = tmp_path / "ix"
    ix = open_index("art", d)
    ix.put([entry(h, f"n{h % 4}") for h in range(500)])
    ix.close()
    return d


@pytest.mark.parametrize(
    "where, match",
    [
        (10, "checksum|claims"),  # inside the header
        (20, "checksum"),  # inside the header's metadata
        ("truncate", "outside the file|checksum"),
        ("magic", "not an ART checkpoint"),
        ("format1", "format 1 .*rebuild the index"),
    ],
)
def test_corrupted_checkpoint_header_is_refused_and_left_untouched(tmp_path, where, match):
    d = _built(tmp_path)
    ck = d / CHECKPOINT
    data = bytearray(ck.read_bytes())
    if where == "truncate":
        data = data[: len(data) // 2]
    elif where == "magic":
        data[:8] = b"NOTACKPT"
    elif where == "format1":
        data[:8] = b"QCARTCK1"  # a checkpoint of the dict-meta format
    else:
        data[where] ^= 0x55
    ck.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(IndexCorruptionError, match=match):
        open_index("art", d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


@given(pos=st.integers(0, 10**9), bit=st.integers(0, 7))
@settings(max_examples=25, deadline=None)
def test_corrupted_arena_byte_is_caught_before_any_answer(tmp_path_factory, pos, bit):
    d = _built(tmp_path_factory.mktemp("ck"))
    ck = d / CHECKPOINT
    data = bytearray(ck.read_bytes())
    meta_len = struct.unpack_from("<I", data, 8)[0]
    meta = msgpack.unpackb(bytes(data[16 : 16 + meta_len]), raw=False, strict_map_key=False)
    regions = [(t["offset"], t["len"]) for t in (meta["primary"], meta["secondary"])]
    total = sum(n for _, n in regions)
    k = pos % total  # a byte inside one of the arenas (padding between them is not data)
    off, n = regions[0] if k < regions[0][1] else regions[1]
    i = off + (k if k < regions[0][1] else k - regions[0][1])
    data[i] ^= 1 << bit
    ck.write_bytes(bytes(data))
    before = ck.read_bytes()
    with pytest.raises(IndexCorruptionError, match="checksum|corrupt"):
        open_index("art", d, verify_checkpoint="eager")
    try:
        ix = open_index("art", d)  # lazy: O(1) open, chunks verified on first touch
    except IndexCorruptionError:
        return  # the damage hit a byte attach itself checks
    with pytest.raises(IndexCorruptionError, match="checksum|corrupt"):
        ix.scan_prefix(b"")  # touches every live node and leaf
    with pytest.raises(IndexCorruptionError):
        ix.checkpoint()  # never re-blesses damaged bytes
    del ix
    assert ck.read_bytes() == before


def test_lazy_reopen_answers_exactly(tmp_path):
    d = _built(tmp_path)
    ix = open_index("art", d)
    assert ix._primary.stats()["chunks_verified"] == 0
    got = ix.locate([5, 6, 7])
    assert [len(x) for x in got] == [1, 1, 1]
    assert 0 < ix._primary.stats()["chunks_verified"] <= ix._primary.stats()["chunks_total"]
    ix.close()
    with pytest.raises(ValueError, match="verify_checkpoint"):
        open_index("art", d, verify_checkpoint="never")


def test_damaged_acknowledged_wal_record_is_refused(tmp_path):
    d = tmp_path / "ix"
    ix = open_index("art", d)
    for i in range(5):
        ix.put([entry(i)])
        ix.flush()
    del ix  # crash: no checkpoint, everything lives in the WAL
    data = bytearray((d / WAL).read_bytes())
    data[40] ^= 0xFF  # first record, acknowledged by the later ones
    (d / WAL).write_bytes(bytes(data))
    with pytest.raises(IndexCorruptionError, match="acknowledged"):
        open_index("art", d)


def test_crash_between_checkpoint_rename_and_wal_swap(tmp_path):
    d = tmp_path / "ix"
    ix = open_index("art", d)
    ix.put([entry(h) for h in range(100)])
    ix.flush()
    old_wal = (d / WAL).read_bytes()
    ix.checkpoint()
    want = snapshot(ix)
    del ix
    (d / WAL).write_bytes(old_wal)  # the new checkpoint is in place, the old WAL not yet replaced
    ix = open_index("art", d)
    assert snapshot(ix) == want
    ix.put([entry(7777)])
    ix.flush()
    del ix
    ix = open_index("art", d)
    assert len(ix.locate([7777])[0]) == 1 and len(snapshot(ix)) == len(want) + 2
    ix.close()


def test_running_checkpoints_and_reopen(tmp_path):
    d = tmp_path / "ix"
    ix = open_index("art", d, checkpoint_min_wal_bytes=4096, checkpoint_wal_ratio=0.01)
    for i in range(40):
        ix.put([entry(i * 100 + j, f"n{j % 3}") for j in range(20)])
        ix.remove([entry(i * 100)])
        ix.flush()
    assert ix.checkpoint_bytes_written > 0
    want = snapshot(ix)
    del ix
    ix = open_index("art", d)
    assert snapshot(ix) == want
    on_n1 = ix.entries_on_node("n1")
    assert len(on_n1) == 40 * 7 and all(e.node == "n1" for e in on_n1)  # j % 3 == 1 for 7 of 20 j
    ix.close()


def test_not_an_index(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "data.bin").write_bytes(b"hello")
    with pytest.raises(ValueError, match="not an ART index"):
        open_index("art", tmp_path / "x")
    (tmp_path / "f").write_text("file")
    with pytest.raises(ValueError, match="is a file, not an index directory"):
        open_index("art", tmp_path / "f")


CHILD = textwrap.dedent(
    """
    import sys
    from quillcache.index import open_index
    from quillcache.index.keys import ResidencyEntry
    from quillcache.types import CacheTier
    ix = open_index("art", sys.argv[1], checkpoint_min_wal_bytes=1 << 12, checkpoint_wal_ratio=0.5)
    start = int(sys.argv[2])
    for b in range(start, start + 100000):
        ix.put([ResidencyEntry(b * 8 + i, "n0", CacheTier.DRAM, bytes(16), 0, b, 1) for i in range(8)])
        ix.flush()
        print(b, flush=True)
    """
)


def _acks_until(p: subprocess.Popen, n: int, deadline_s: float) -> tuple[list[int], bytes]:
    """Batch numbers the child acknowledged, read until ``n`` arrived, EOF or the deadline, and
    the bytes of a line not complete yet."""
    fd, buf, acks = p.stdout.fileno(), b"", []
    deadline = time.monotonic() + deadline_s
    while len(acks) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, buf = (buf + chunk).split(b"\n")
        acks += [int(x) for x in lines]
    return acks, buf


def test_sigkill_after_n_acknowledged_batches_loses_none(tmp_path):
    d = tmp_path / "ix"
    rng = random.Random(7)
    acked_upto = -1
    for round_ in range(4):
        n = rng.randint(1, 400)  # kill once the child acknowledged this many batches
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(d), str(acked_upto + 1)], stdout=subprocess.PIPE)
        acks, partial = _acks_until(p, n, deadline_s=120.0)
        p.send_signal(signal.SIGKILL)
        p.wait()
        acks += [int(x) for x in (partial + p.stdout.read()).split()]  # acks that reached the pipe before the kill
        p.stdout.close()
        assert len(acks) >= n, f"round {round_}: the child acknowledged only {len(acks)} of {n} batches"
        assert acks == list(range(acked_upto + 1, acked_upto + 1 + len(acks)))
        acked_upto = acks[-1]
        ix = open_index("art", d)
        hashes = [b * 8 for b in range(acked_upto + 1)]
        found = ix.locate_arrays(hashes)
        assert all(found.count(j) == 1 for j in range(len(hashes))), f"round {round_}: lost an acknowledged batch"
        ix.close()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 3), st.sampled_from([b"\x01" * 16, b"\x02" * 16]),
                          st.booleans()), max_size=20))
def test_wal_payload_round_trips_and_derives_secondary_keys(ops):
    # The WAL logs primary and node-name operations only, compressed; replay derives the N keys.
    from quillcache.index import keys as K
    from quillcache.index.art_index import decode_wal_batch, encode_wal_batch

    puts, dels = [(K.node_name_key("n0"), (1).to_bytes(4, "big"))], []
    for h, tier, ident, is_put in ops:
        pk, sk = K.primary_key(h, 1, tier, ident), K.secondary_key(h, 1, tier, ident)
        if is_put:
            puts += [(pk, K.pack_value(1, h % 1000, 64)), (sk, b"")]
        else:
            dels += [pk, sk]
    got_puts, got_dels = decode_wal_batch(encode_wal_batch(puts, dels))
    assert sorted(got_puts) == sorted(puts) and sorted(got_dels) == sorted(dels)


def test_wal_payload_of_an_unknown_format_is_refused(tmp_path):
    from quillcache.index.art_index import decode_wal_batch

    with pytest.raises(ValueError, match="unknown WAL payload format"):
        decode_wal_batch(b"\x01rest")


# ------------------------------------------------------------------ on the crash simulator
def _crashfs_batches(fs, rng: random.Random, states: list, run: dict) -> None:
    """Random put/remove batches through an ART index on ``fs`` (small checkpoint thresholds, so
    checkpoints happen during the run); ``states[k]`` is the content after batch k,
    ``run["acked"]`` the last batch a returned ``flush()`` covered."""
    ix = open_index("art", "/x/ix", fs=fs, checkpoint_min_wal_bytes=1024, checkpoint_wal_ratio=0.05)
    for _ in range(60):
        node, tier = f"n{rng.randrange(3)}", CacheTier(rng.randrange(3))
        if rng.random() < 0.75:
            ix.put([entry(rng.randrange(400), node, tier, rng.randrange(10**6)) for _ in range(rng.randint(1, 6))])
        else:
            ix.remove([entry(rng.randrange(400), node, tier)])
        states.append(snapshot(ix))
        if rng.random() < 0.4:
            ix.flush()
            run["acked"] = len(states) - 1
            run["checkpoint_bytes"] = ix.checkpoint_bytes_written
    ix.close()
    run["acked"] = len(states) - 1


def test_power_loss_at_every_sync_point_keeps_exactly_a_batch_prefix():
    from quillcache.durability.crashfs import CrashFs, SimulatedCrash

    clean, run = CrashFs(), {"acked": 0}
    _crashfs_batches(clean, random.Random(3), [[]], run)
    assert run["checkpoint_bytes"] > 0  # the power losses below also land inside checkpoints
    total_syncs = clean.sync_calls
    assert total_syncs > 20
    beyond_ack = 0
    for crash_at in range(1, total_syncs + 2):
        for seed in range(3):
            fs = CrashFs(crash_at_sync=crash_at)
            states, run = [[]], {"acked": 0}
            try:
                _crashfs_batches(fs, random.Random(3), states, run)
            except SimulatedCrash:
                pass
            crash_rng = random.Random(crash_at * 100 + seed)
            ix = open_index("art", "/x/ix", fs=fs.crash(crash_rng))
            got = snapshot(ix)
            # exactly the state after some batch at or after the last acknowledged one
            matches = [k for k in range(run["acked"], len(states)) if states[k] == got]
            assert matches, f"crash at sync {crash_at}, seed {seed}: not a batch prefix >= batch {run['acked']}"
            beyond_ack += matches[0] > run["acked"]
            ix.close()
    assert beyond_ack > 0  # some crashes kept unacknowledged (written, unsynced) batches too


def test_checkpoint_is_durably_in_place_before_the_wal_is_replaced():
    from quillcache.durability.crashfs import CrashFs

    class Recording(CrashFs):
        def __init__(self):
            super().__init__()
            self.ops: list[tuple[str, str]] = []
            self._names: dict[int, str] = {}

        def open(self, path, mode):
            fd = super().open(path, mode)
            self._names[fd] = path
            return fd

        def fsync(self, fd):
            super().fsync(fd)
            self.ops.append(("fsync", self._names[fd]))

        fdatasync = fsync

        def rename(self, src, dst):
            super().rename(src, dst)
            self.ops.append(("rename", dst))

        def fsync_dir(self, path):
            super().fsync_dir(path)
            self.ops.append(("fsync_dir", path))

    fs = Recording()
    ix = open_index("art", "/r/ix", fs=fs)
    ix.put([entry(h) for h in range(50)])
    ix.flush()
    fs.ops.clear()
    ix.checkpoint()
    ck, wal = f"/r/ix/{CHECKPOINT}", f"/r/ix/{WAL}"
    assert fs.ops == [
        ("fsync", ck + ".tmp"), ("rename", ck), ("fsync_dir", "/r/ix"),  # the checkpoint, durably in place
        ("fsync", wal + ".tmp"), ("rename", wal), ("fsync_dir", "/r/ix"),  # then the new WAL
    ], fs.ops
    want = snapshot(ix)
    ix.close()
    assert snapshot(open_index("art", "/r/ix", fs=fs.snapshot())) == want


def test_checkpoint_read_into_memory_on_crashfs_is_still_verified():
    from quillcache.durability.crashfs import CrashFs

    fs = CrashFs()
    ix = open_index("art", "/v/ix", fs=fs)
    ix.put([entry(h, f"n{h % 4}") for h in range(500)])
    ix.close()
    good = open_index("art", "/v/ix", fs=fs.snapshot())  # a FileSystem without mmap: read, then attached
    assert good._primary.stats()["chunks_verified"] == 0 and len(good.locate([5])[0]) == 1
    good.close()
    raw = fs.read_file(f"/v/ix/{CHECKPOINT}")
    meta_len = struct.unpack_from("<I", raw, 8)[0]
    meta = msgpack.unpackb(raw[16 : 16 + meta_len], raw=False, strict_map_key=False)
    fs.corrupt(f"/v/ix/{CHECKPOINT}", meta["primary"]["offset"] + meta["primary"]["len"] // 2, 0x10)
    with pytest.raises(IndexCorruptionError, match="checksum|corrupt"):
        open_index("art", "/v/ix", fs=fs, verify_checkpoint="eager")


# ---- hostile logs: nothing dropped in silence, no overflow, every option checked ------------------


def test_a_dropped_log_tail_is_reported_and_announced(tmp_path):
    from quillcache.index.art_index import IndexRecoveryWarning

    ix = open_index("art", str(tmp_path))
    for h in range(1, 40):
        ix.put([entry(h)])
        ix.flush()
    ix._wal.close()  # simulate a crash: no checkpoint at close
    ix._wal = None
    ix._dir_lock.release()  # (as the process's death would)
    os.truncate(tmp_path / WAL, 100)  # used to reopen with no word at all
    with pytest.warns(IndexRecoveryWarning, match=r"art\.wal: dropped \d+ bytes after lsn \d+"):
        again = open_index("art", str(tmp_path))
    report = again.recovery_report
    assert report.valid_bytes + report.dropped_bytes == 100 and report.dropped_bytes > 0
    assert "bad or torn record" in report.dropped_reason
    assert len(again) == report.last_lsn  # one entry per surviving batch, and the report says how many
    again.close()


def test_a_log_missing_next_to_its_checkpoint_is_refused_unless_accepted(tmp_path):
    ix = open_index("art", str(tmp_path))
    ix.put([entry(1)])
    ix.close()  # checkpoint + fresh log
    os.unlink(tmp_path / WAL)
    with pytest.raises(IndexCorruptionError, match=r"art\.wal is missing next to .*art\.ckpt"):
        open_index("art", str(tmp_path))
    assert not (tmp_path / WAL).exists()  # refusing changed nothing
    again = open_index("art", str(tmp_path), on_missing_wal="checkpoint")
    assert len(again) == 1
    again.close()


def test_options_and_hostile_headers_give_typed_errors(tmp_path):
    import random as _random

    from experiments.recovery_bench import fake_header_image
    from quillcache.durability import wal as W

    with pytest.raises(ValueError, match=r"wal_recovery='yolo' must be one of"):
        open_index("art", str(tmp_path / "a"), wal_recovery="yolo")
    with pytest.raises(ValueError, match=r"on_missing_wal='drop' must be one of"):
        open_index("art", str(tmp_path / "b"), on_missing_wal="drop")
    for name, image in (("fake", fake_header_image(256 << 10, _random.Random(3))),
                        ("top", W.encode_header(7, W.MAX_LSN) + os.urandom(200))):  # LSN near 2**64: no OverflowError
        d = tmp_path / name
        d.mkdir()
        (d / WAL).write_bytes(image)
        try:
            ix = open_index("art", str(d))
        except IndexCorruptionError as exc:
            assert str(d / WAL) in str(exc)
        else:
            assert len(ix) == 0 and ix.recovery_report.dropped_bytes > 0
            ix.close()
