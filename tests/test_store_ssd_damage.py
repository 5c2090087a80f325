"""The SSD tier always reopens (issue 11): generated damage to a closed tier's directory, then reopen.

Oracle (both layouts): opening never raises anything but the documented refusal of a slab tier whose log is
gone or unusable (``SsdLogMissingError``, after which ``on_missing_log="empty"`` opens it, not clean); every
block whose bytes (and, for the slab layout, whose log) the damage did not touch is served bit-exact; no block
is served with wrong bytes; a block that is not served is named by key in ``recovery.dropped`` (files layout:
by its object file when the damage left no readable header), or the report says the log was damaged (slab
layout: a damaged log record's keys are unreadable; a log cut at a record boundary is indistinguishable from a
crash before the later commits, so log truncation is accepted as such), or its object file was deleted or
renamed to a foreign name (files layout: the directory is the manifest, so a deleted object leaves no trace);
damaged files end up in ``quarantine/``, never deleted. Plus one regression test per reproduction of issue 11
items 1, 3, 4, 10.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.durability.wal import HEADER_BYTES as WAL_HEADER_BYTES
from quillcache.durability.wal import RECORD_HEADER_BYTES, scan
from quillcache.store import ssd_log
from quillcache.store.errors import CorruptBlockError, SsdLogMissingError, StoreError
from quillcache.store.keys import StoreKey
from quillcache.store.ssd import SsdTier

CAP = 1 << 20
TUNING = dict(slab_bytes=64 << 10, log_rotate_bytes=1 << 20)
STRAY_NAMES = ("slab-00042.qcs", "slab-00000.qcs.tmp", "o-ffffffff.qco", "o-00000fff.qco", "log-99999999.qcl",
               "log-00000000.qcl", "junk.bin", "o-00000002.tmp")


def key(i: int) -> StoreKey:
    return StoreKey(i, bytes([9]) * 16)


def content(k: StoreKey, n: int) -> bytes:
    return random.Random(k.to_bytes()).randbytes(n)


SIZES: dict[StoreKey, int] = {}  # every block ever put (a lost delete may bring one back, bit-exact)


def _build(layout: str, d: str) -> dict[StoreKey, tuple[str, int, int]]:
    """A closed tier holding known blocks; returns key -> (file, first byte, end byte) it occupies."""
    rng = random.Random(5)
    with SsdTier(d, capacity_bytes=CAP, layout=layout, **TUNING) as t:
        for i in range(14):
            SIZES[key(i)] = rng.randint(100, 20000)
            t.put(key(i), content(key(i), SIZES[key(i)]))
        t.delete(key(3))
        SIZES[key(100)] = 777
        t.put(key(100), content(key(100), 777))
        where = {}
        for k in t.keys():
            seg, off, size = t.location_of(k)
            if layout == "slab":
                where[k] = (f"slab-{seg:05d}.qcs", off, off + size)
            else:
                where[k] = (f"o-{seg:08x}.qco", 0, off + size)  # the whole object file (header + payload)
    return where


_PRISTINE: dict[str, tuple[str, dict]] = {}
# slab layout: the pristine log file's name and its records as (first byte, end byte, keys named)
_LOG_RECORDS: dict[str, tuple[str, list[tuple[int, int, set[StoreKey]]]]] = {}


def _log_records(d: str) -> tuple[str, list[tuple[int, int, set[StoreKey]]]]:
    (name,) = [n for n in os.listdir(d) if n.startswith("log-")]
    out, pos = [], WAL_HEADER_BYTES
    for _, payload in scan(os.path.join(d, name))[1]:
        end = pos + RECORD_HEADER_BYTES + len(payload)
        out.append((pos, end, {StoreKey.from_bytes(e[1]) for e in ssd_log.decode_record(payload)[1]}))
        pos = end
    return name, out


def _pristine(layout: str) -> tuple[str, dict]:
    if layout not in _PRISTINE:
        root = tempfile.mkdtemp(prefix="qc-ssd-damage-")
        atexit.register(shutil.rmtree, root, True)
        d = os.path.join(root, "tier")
        _PRISTINE[layout] = (d, _build(layout, d))
        if layout == "slab":
            _LOG_RECORDS[layout] = _log_records(d)
    return _PRISTINE[layout]


damage_op = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("extend"), st.integers(1, 9000)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("delete")),
    st.tuples(st.just("stray"), st.sampled_from(STRAY_NAMES), st.integers(1, 300)),
    st.tuples(st.just("rename"), st.sampled_from(STRAY_NAMES + ("foreign.qco",))),
)


class _Damage:
    """Applies ops to a directory and remembers what they could have hit."""

    def __init__(self, d: str) -> None:
        self.d = d
        self.hit: dict[str, list[tuple[int, int]]] = {}  # file -> byte ranges whose content changed
        self.gone: set[str] = set()  # files deleted, renamed away or replaced
        self.vanished: set[str] = set()  # files deleted or renamed to a foreign name (no trace left)
        # a log cut at a record boundary looks exactly like a crash before the later commits: unreported
        self.log_truncated = False
        self.alias: dict[str, str] = {}  # original file name -> the name a rename gave it

    def _orig(self, now: str) -> str:
        """The original name of the file now called ``now``."""
        return next((o for o, cur in self.alias.items() if cur == now), now)

    def files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.d)
                      if n != "quillcache-ssd.meta" and os.path.isfile(os.path.join(self.d, n)))

    def apply(self, target: int, op: tuple) -> None:
        names = self.files()
        kind = op[0]
        if kind == "stray":
            path = os.path.join(self.d, op[1])
            if op[1] in names:
                self.gone.add(op[1])
                over = self._orig(op[1])
                self.vanished.add(over)
                self.alias[over] = "(overwritten)"
            with open(path, "wb") as fh:
                fh.write(random.Random(op[2]).randbytes(op[2]))
            return
        if not names:
            return
        name = names[target % len(names)]
        path = os.path.join(self.d, name)
        size = os.path.getsize(path)
        if kind == "truncate":
            new = op[1] * size // 10**6
            os.truncate(path, new)
            self.log_truncated |= name.startswith("log-")
            self.hit.setdefault(name, []).append((new, 1 << 62))
        elif kind == "extend":
            with open(path, "ab") as fh:
                fh.write(bytes(range(256)) * (op[1] // 256) + bytes(op[1] % 256))
            self.hit.setdefault(name, []).append((size, 1 << 62))
        elif kind == "flip" and size:
            pos = op[1] * (size - 1) // 10**6
            with open(path, "r+b") as fh:
                fh.seek(pos)
                b = fh.read(1)[0]
                fh.seek(pos)
                fh.write(bytes([b ^ (1 << op[2])]))
            self.hit.setdefault(name, []).append((pos, pos + 1))
        elif kind == "delete":
            os.unlink(path)
            self.gone.add(name)
            self.vanished.add(self._orig(name))
        elif kind == "rename" and op[1] != name:
            orig = self._orig(name)
            if op[1] in names:  # the file there is overwritten: it leaves no trace
                over = self._orig(op[1])
                self.vanished.add(over)
                self.alias[over] = "(overwritten)"
            os.replace(path, os.path.join(self.d, op[1]))
            self.alias[orig] = op[1]
            self.gone |= {name, op[1]}
            if not op[1].endswith(".qco") or op[1] == "foreign.qco":
                self.vanished.add(orig)  # files layout: now foreign or a temp name (swept): no trace left

    def touched(self, name: str, start: int, end: int, layout: str) -> bool:
        if name in self.gone:
            return True
        for a, b in self.hit.get(name, []):
            if layout == "files" or a < end + 4096 and b > start:  # + a page: a slab is used in whole pages
                return True
        return False

    def log_touched(self) -> bool:
        return any(n.startswith("log-") for n in set(self.hit) | self.gone)

    def log_may_lose(self, layout: str) -> set[StoreKey] | None:
        """The blocks the log's damage may cost: salvage skips only the records a flip or an appended
        tail hit, so only the keys those records name (slab layout); None when any block may be lost
        (the log header hit, the log cut, deleted, renamed or overwritten)."""
        if layout != "slab":
            return set()
        name, records = _LOG_RECORDS[layout]
        if name in self.gone or self.log_truncated:
            return None
        keys: set[StoreKey] = set()
        for a, b in self.hit.get(name, []):
            if a < WAL_HEADER_BYTES:
                return None
            for start, end, named in records:
                if a < end and b > start:
                    keys |= named
        return keys


def _check_tier(t: SsdTier, where: dict, dmg: _Damage, layout: str) -> None:
    rep = t.recovery
    dropped_keys = {k for k, _ in rep.dropped}
    log_lost = layout == "slab" and bool(rep.log_damaged_lsns or rep.log_tail or dmg.log_truncated
                                         or any(n.startswith("log-") for n, _ in rep.dropped))
    for k in list(t.keys()):
        assert k in SIZES, f"{k.hex()} served but never stored"
        try:
            data = t.get(k)
        except CorruptBlockError:
            continue  # detected on read: never served wrong
        assert data == content(k, SIZES[k]), k.hex()
    may_lose = dmg.log_may_lose(layout)
    for k, (name, start, end) in where.items():
        intact = not dmg.touched(name, start, end, layout) and may_lose is not None and k not in may_lose
        if intact:
            assert k in t, f"intact block {k.hex()} in {name} [{start}, {end}) not served; {rep}"
        elif k not in t:
            by_file = layout == "files" and dmg.alias.get(name, name) in dropped_keys  # header unreadable
            assert k.hex() in dropped_keys or by_file or log_lost or (layout == "files" and name in dmg.vanished), \
                (k.hex(), name, rep)
    if rep.quarantined:
        assert all(os.path.isfile(os.path.join(t.directory, q)) for q in rep.quarantined)


# `make fuzz` scales this up (each example builds and damages a real directory, so a twentieth of
# the parsers' budget)
_EXAMPLES = (int(os.environ.get("QUILLCACHE_FUZZ_EXAMPLES", "20000")) // 20
             if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else 150)


@pytest.mark.parametrize("layout", ["slab", "files"])
@settings(max_examples=_EXAMPLES, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 50), damage_op), min_size=1, max_size=4))
def test_damaged_directory_always_reopens(layout, ops):
    src, where = _pristine(layout)
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "tier")
        shutil.copytree(src, d)
        dmg = _Damage(d)
        for target, op in ops:
            dmg.apply(target, op)
        try:
            t = SsdTier(d, capacity_bytes=CAP)
        except SsdLogMissingError as exc:  # the documented refusal: the slab layout's log is gone
            # only a log that is gone or whose header is hit: damage to records is salvaged
            assert layout == "slab" and dmg.log_may_lose(layout) is None and "on_missing_log" in str(exc)
            t = SsdTier(d, capacity_bytes=CAP, on_missing_log="empty")
            assert len(t) == 0 and not t.recovery.clean and t.recovery.log_tail
        if "started empty" not in t.recovery.log_tail:
            _check_tier(t, where, dmg, layout)
        served = {k: t.get(k) for k in list(t.keys()) if k in t}
        t.put(StoreKey(10**6, bytes([1]) * 16), b"after damage" * 50)  # still writable
        t.close()
        with SsdTier(d, capacity_bytes=CAP) as t2:  # and the repaired directory reopens as it was left
            for k, data in served.items():
                assert t2.get(k) == data
            assert t2.get(StoreKey(10**6, bytes([1]) * 16)) == b"after damage" * 50


# ---------------------------------------------------------------- issue 11 reproductions

def _ten_blocks(d, **kw) -> None:
    with SsdTier(d, capacity_bytes=64 << 20, slab_bytes=4 << 20, **kw) as t:
        for i in range(10):
            t.put(key(i), content(key(i), 64 << 10))


@pytest.mark.parametrize("change", ["truncate", "extend", "stray"])
def test_item1_slab_of_odd_size_reopens(tmp_path, change):
    d = tmp_path / "t"
    _ten_blocks(d)
    slab = d / "slab-00000.qcs"
    if change == "truncate":
        os.truncate(slab, (4 << 20) - 100)
    elif change == "extend":
        with open(slab, "ab") as fh:
            fh.write(b"xyz")
    else:
        os.rename(slab, d / "slab-00007.qcs")
        slab.write_bytes(b"!")  # a stray 1-byte file named like a slab
    with SsdTier(d, capacity_bytes=64 << 20) as t:
        rep = t.recovery
        assert not rep.clean
        if change == "stray":
            assert len(t) == 0 and {k for k, _ in rep.dropped} >= {key(i).hex() for i in range(10)}
            assert any(q.endswith("slab-00000.qcs") for q in rep.quarantined)
        else:
            assert [t.get(key(i)) == content(key(i), 64 << 10) for i in range(10)] == [True] * 10
        t.put(key(50), b"still writable")
    with SsdTier(d, capacity_bytes=64 << 20) as t:
        assert t.get(key(50)) == b"still writable"


def test_item3_deleted_log_is_refused_then_forced_empty(tmp_path):
    d = tmp_path / "t"
    _ten_blocks(d)
    (log,) = [n for n in os.listdir(d) if n.endswith(".qcl")]
    os.unlink(d / log)
    with pytest.raises(SsdLogMissingError, match="on_missing_log"):
        SsdTier(d, capacity_bytes=64 << 20)
    assert sorted(os.listdir(d)) == ["quillcache-ssd.lock", "quillcache-ssd.meta", "slab-00000.qcs"]  # unchanged
    with SsdTier(d, capacity_bytes=64 << 20, on_missing_log="empty") as t:
        assert len(t) == 0 and not t.recovery.clean and "no log" in t.recovery.log_tail
        assert t.recovery.quarantined and os.path.isfile(d / t.recovery.quarantined[0])


def test_item3_damaged_log_header_keeps_the_evidence(tmp_path):
    d = tmp_path / "t"
    _ten_blocks(d)
    (log,) = [n for n in os.listdir(d) if n.endswith(".qcl")]
    raw = bytearray((d / log).read_bytes())
    raw[5] ^= 0x01  # one bit in the log header
    (d / log).write_bytes(bytes(raw))
    with pytest.raises(SsdLogMissingError, match=log):
        SsdTier(d, capacity_bytes=64 << 20)
    with SsdTier(d, capacity_bytes=64 << 20, on_missing_log="empty") as t:
        assert not t.recovery.clean and any(n == log for n, _ in t.recovery.dropped)
        (q,) = [q for q in t.recovery.quarantined if q.endswith(log)]
        assert (d / q).read_bytes() == bytes(raw)  # moved, never deleted


def test_item3_missing_log_with_no_slab_is_a_fresh_tier(tmp_path):
    """A crash between writing the metadata and the first log leaves no slab: nothing was stored."""
    d = tmp_path / "t"
    SsdTier(d, capacity_bytes=1 << 20).close()
    for n in os.listdir(d):
        if n.endswith(".qcl"):
            os.unlink(d / n)
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert len(t) == 0


def test_item4_largest_object_number_does_not_block_puts(tmp_path):
    d = tmp_path / "f"
    with SsdTier(d, capacity_bytes=1 << 20, layout="files") as t:
        t.put(key(1), b"one")
    (d / "o-ffffffff.qco").write_bytes(b"z")
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert [n for n, _ in t.recovery.dropped] == ["o-ffffffff.qco"] and t.recovery.quarantined
        for i in range(2, 6):
            t.put(key(i), b"more %d" % i)
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert [t.get(key(i)) for i in range(1, 6)] == [b"one"] + [b"more %d" % i for i in range(2, 6)]


def test_item4_object_numbers_wrap_to_free_ones(tmp_path):
    """A valid object holding the largest number: later puts take free lower numbers."""
    d = tmp_path / "f"
    with SsdTier(d, capacity_bytes=1 << 20, layout="files") as t:
        t.put(key(1), b"one")
        t.put(key(2), b"two")
    from quillcache.store import ssd_files
    raw = (d / "o-00000002.qco").read_bytes()
    kb, size, crc, _ = ssd_files.decode_header(raw)
    (d / "o-ffffffff.qco").write_bytes(ssd_files.encode_header(kb, size, crc, 0xFFFFFFFF) + raw[64:])
    os.unlink(d / "o-00000002.qco")
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert t.recovery.clean and t.get(key(2)) == b"two"
        t.put(key(3), b"three")
        assert t.location_of(key(3))[0] == 2
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert [t.get(key(i)) for i in (1, 2, 3)] == [b"one", b"two", b"three"]


@pytest.mark.parametrize("layout", ["slab", "files"])
def test_item10_directory_where_a_file_should_be(tmp_path, layout):
    """A directory holding a name the tier would create is foreign: skipped, never an OSError."""
    d = tmp_path / "t"
    with SsdTier(d, capacity_bytes=1 << 20, layout=layout, slab_bytes=64 << 10) as t:
        t.put(key(1), b"one")
    for name in ("log-00000001.qcl", "log-00000002.qcl", "slab-00001.qcs", "o-00000002.qco", "o-00000002.tmp"):
        os.mkdir(d / name)
    with SsdTier(d, capacity_bytes=1 << 20, log_rotate_bytes=1) as t:  # rotates the log at every commit
        for i in range(2, 40):
            t.put(key(i), bytes([i]) * 5000)  # the slab layout needs a second slab
    with SsdTier(d, capacity_bytes=1 << 20) as t:
        assert [t.get(key(i)) for i in range(2, 40)] == [bytes([i]) * 5000 for i in range(2, 40)]
        assert t.get(key(1)) == b"one"


def test_item10_log_is_a_directory(tmp_path):
    """Where the only log should be there is a directory: a StoreError naming the path."""
    d = tmp_path / "t"
    _ten_blocks(d)
    (log,) = [n for n in os.listdir(d) if n.endswith(".qcl")]
    os.unlink(d / log)
    os.mkdir(d / log)
    with pytest.raises(StoreError, match="no log file"):
        SsdTier(d, capacity_bytes=64 << 20)
    with SsdTier(d, capacity_bytes=64 << 20, on_missing_log="empty") as t:
        assert log in t.recovery.foreign_files and not t.recovery.clean


def test_io_error_while_opening_is_a_store_error(tmp_path):
    """An OSError below recovery (here: a slab that cannot be opened) surfaces as SsdRecoveryError."""
    from quillcache.durability.fs import RealFs
    from quillcache.store.errors import SsdRecoveryError

    class DeniedSlabs(RealFs):
        def open(self, path: str, mode: str) -> int:
            if path.endswith(".qcs"):
                raise PermissionError(13, "Permission denied", path)
            return super().open(path, mode)

    d = tmp_path / "t"
    _ten_blocks(d)
    with pytest.raises(SsdRecoveryError, match="PermissionError"):
        SsdTier(d, capacity_bytes=64 << 20, fs=DeniedSlabs())
    with SsdTier(d, capacity_bytes=64 << 20) as t:  # nothing was changed
        assert len(t) == 10 and t.recovery.clean
