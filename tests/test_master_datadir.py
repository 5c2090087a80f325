"""The master's data dir and start-up refusals: one master per data dir (a second one, in any process, is
refused naming the dir and the holder's pid, and the first keeps serving; the lock goes with a clean stop, a
SIGKILL, a reopen and a forked child); a damaged, empty or foreign log refused in one line with nothing changed;
``--data-dir`` values that cannot work and out-of-range durations refused at start (exit 2 naming the flag), on
the command line and in the constructors (ValueError); a timer thread that breaks stops the process."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_master_rpc import Server

from quillcache.cli import OneLineParser
from quillcache.cli.master import configure
from quillcache.master import MasterConfig, MasterService, PutRequest, SegmentDescriptor
from quillcache.master.client import MasterClient
from quillcache.durability.dirlock import LOCK_NAME, DataDirInUseError, DataDirLock
from quillcache.master.types import MAX_DURATION_S

ROOT = Path(__file__).resolve().parents[1]
EXIT_DEADLINE_S = 15.0  # a refused master exits within this
UNIT = 4096


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def Master(data_dir: Path, *extra: str) -> Server:
    """One master process (``test_master_rpc.Server``) that expires no client while a test runs."""
    return Server(data_dir, "--client-ttl-s", "3600", *extra)


def _run_master(*args: str) -> subprocess.CompletedProcess:
    """``quillcache master ARGS`` expected to exit on its own (killed at the deadline, which fails the test)."""
    return subprocess.run([sys.executable, "-m", "quillcache", "master", *args], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), timeout=EXIT_DEADLINE_S)


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _put(c, keys) -> None:
    for k in keys:
        r = c.put_start(k, UNIT)
        c.put_end(k, put_id=r.put_id)


def _digests(d: Path) -> dict[str, str]:
    """Every file of ``d`` but the lock file, by name: its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != LOCK_NAME}


# ---------------------------------------------------------------------------------------- one master per dir
def test_a_second_master_in_this_process_is_refused_until_the_first_closes(tmp_path):
    d = tmp_path / "d"
    first = MasterService(MasterConfig(), data_dir=d)
    try:
        first.mount_segment(SegmentDescriptor(node_id="n", segment_id=0, capacity_bytes=1 << 20))
        want = f"{d} is in use by another master (pid {os.getpid()}, this process"
        with pytest.raises(DataDirInUseError, match=re.escape(want)):
            MasterService(MasterConfig(), data_dir=str(d))
        first.batch_put_start([PutRequest(key="k", size_bytes=10)])  # the refusal touched nothing of the first
        first.put_end("k")
    finally:
        first.close()
    again = MasterService(MasterConfig(), data_dir=d)  # a close releases the dir
    try:
        assert again.keys() == ["k"]
    finally:
        again.close()


def test_an_ha_master_holds_its_dir_across_reopens_and_a_forked_child_never_holds_it(tmp_path):
    from quillcache.master.ha import HaMaster

    d = tmp_path / "ha"
    node = HaMaster(str(d), MasterConfig(), etcd="127.0.0.1:1", name="m", candidate="c")  # (no etcd needed yet)
    try:
        node._reopen("test")  # as after a refused commit: the service closes and reopens; the dir stays locked
        with pytest.raises(DataDirInUseError, match=re.escape(str(d))):
            MasterService(MasterConfig(), data_dir=d)
        rfd, wfd = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a child that outlives its parent's hold (as a snapshot writer orphaned by a SIGKILL may)
            os.close(wfd)
            os.write(ready_w, b"r")  # (os.fork has returned here: the child's copies are closed by now)
            os.read(rfd, 1)
            os._exit(0)
        os.close(rfd)
        os.close(ready_w)
        try:
            assert os.read(ready_r, 1) == b"r"
            node.close()
            with DataDirLock(d) as lock:  # the child's copy of the lock file did not keep the lock
                assert lock.held
        finally:
            os.close(wfd)
            os.close(ready_r)
            os.waitpid(pid, 0)
    finally:
        node.close()


def test_a_second_master_process_is_refused_and_the_first_keeps_every_write(tmp_path):
    d = tmp_path / "m"
    first = Master(d)
    try:
        with MasterClient(first.address, timeout_s=5) as c:
            c.mount_segment(SegmentDescriptor(node_id="n", segment_id=0, capacity_bytes=1 << 24))
            _put(c, [f"a{i}" for i in range(10)])
            res = _run_master("--data-dir", str(d))
            line = _one_line(res.stderr)
            assert res.returncode == 1 and not res.stdout, (res.returncode, res.stdout)
            assert f"data dir {d} is in use by another master (pid {first.proc.pid}" in line, line
            _put(c, [f"b{i}" for i in range(10)])  # still serving, alone
            assert len(c.keys()) == 20
        first.proc.send_signal(signal.SIGKILL)  # a crash releases the dir too
        first.proc.wait(timeout=EXIT_DEADLINE_S)
        second = Master(d)
        try:
            with MasterClient(second.address, timeout_s=5) as c:
                assert sorted(c.keys()) == sorted([f"a{i}" for i in range(10)] + [f"b{i}" for i in range(10)])
        finally:
            second.close()
    finally:
        first.close()


# ---------------------------------------------------------------------------------------- damaged data dirs
def _killed_master_dir(d: Path) -> None:
    """A data dir as a killed master leaves it: a snapshot, then a log tail of 41 records."""
    m = MasterService(MasterConfig(alignment_bytes=UNIT, snapshot_every_records=10**6), data_dir=d)
    m.mount_segment(SegmentDescriptor(node_id="n", segment_id=0, capacity_bytes=1 << 24))
    m.snapshot()
    for i in range(20):
        m.put_start(f"k{i}", UNIT)
        m.put_end(f"k{i}")
    m._log.close()  # no close(): no snapshot, the tail stays in the log
    m.index.close()
    m._dir_lock.release()  # (as the process's death would)


def _flip_middle(wal: Path) -> None:
    data = bytearray(wal.read_bytes())
    data[len(data) // 2] ^= 0xFF
    wal.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    pytest.param(_flip_middle, id="damaged-in-the-middle"),
    pytest.param(lambda wal: wal.write_bytes(b""), id="empty"),
    pytest.param(lambda wal: wal.write_bytes(b"XXXX" + wal.read_bytes()[4:]), id="foreign"),
])
def test_a_damaged_log_is_refused_in_one_line_and_nothing_changes(tmp_path, damage):
    d = tmp_path / "d"
    _killed_master_dir(d)
    good = tmp_path / "good"
    shutil.copytree(d, good)
    with MasterService(MasterConfig(alignment_bytes=UNIT), data_dir=good) as m:  # undamaged, it opens
        assert len(m.keys()) == 20
    damage(d / "master.wal")
    before = _digests(d)
    res = _run_master("--data-dir", str(d))
    line = _one_line(res.stderr)
    assert res.returncode == 1 and not res.stdout
    assert line.startswith(f"quillcache master: cannot open the master in {d}: WalCorruptionError: {d}/master.wal")
    assert _digests(d) == before


def test_bad_data_dir_values_are_refused_with_exit_2(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"precious")
    cases = [("", "--data-dir '' is empty"),
             (str(a_file), f"--data-dir {a_file} is a file, not a directory"),
             (str(a_file / "sub"),
              f"--data-dir {a_file / 'sub'} cannot be created: {a_file} is a file, not a directory"),
             ("/proc/quillcache-test", "--data-dir /proc/quillcache-test cannot be created")]
    for value, want in cases:
        res = _run_master("--data-dir", value)
        line = _one_line(res.stderr)
        assert res.returncode == 2 and line.startswith(f"quillcache master: {want}"), (value, res.returncode, line)
    assert a_file.read_bytes() == b"precious"


# ---------------------------------------------------------------------------------------- durations
@pytest.mark.parametrize("flag,value", [
    ("--tick-s", "1e308"), ("--tick-s", "0"), ("--client-ttl-s", "0"), ("--lease-ttl-s", "0"),
    ("--client-ttl-s", "nan"), ("--lease-ttl-s", "1e308"), ("--stream-idle-timeout-s", "1e308"),
    ("--restart-budget-s", "1e308"), ("--warmup-s", "1e308"), ("--ttl-s", "1000000000"),
    ("--stream-spin-us", "1e308"),
])
def test_out_of_range_durations_are_refused_at_parse_time(tmp_path, capsys, flag, value):
    parser = OneLineParser(prog="quillcache master")  # the command's parser, as `quillcache master` builds it
    configure(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--data-dir", str(tmp_path), flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}: '{value}' is not in " in _one_line(err), err


def test_the_command_refuses_a_huge_tick_before_it_starts(tmp_path):
    res = _run_master("--data-dir", str(tmp_path / "never"), "--tick-s", "1e308")
    line = _one_line(res.stderr)
    assert res.returncode == 2 and not res.stdout and "argument --tick-s: '1e308' is not in (0, 86400]" in line
    assert not (tmp_path / "never").exists()


def test_constructors_refuse_out_of_range_durations_before_anything_starts(tmp_path):
    from quillcache.master.ha import HaMaster
    from quillcache.pool.node import MAX_HEARTBEAT_S, PoolNode

    for bad in (dict(client_ttl_s=0), dict(lease_ttl_s=1e308), dict(client_ttl_s=MAX_DURATION_S * 2),
                dict(restart_budget_s=1e308), dict(lease_ttl_s=float("nan"))):
        with pytest.raises(ValueError, match=f"MasterConfig.{next(iter(bad))}=.* must be"):
            MasterService(MasterConfig(**bad))
    from argparse import Namespace

    from quillcache.master.server import _config
    for name in ("client_ttl_s", "lease_ttl_s"):  # 0 from a caller is refused, never read as "the default"
        with pytest.raises(ValueError, match=re.escape(f"MasterConfig.{name}=0.0 must be in (0.0, {MAX_DURATION_S}]")):
            MasterService(_config(Namespace(**{name: 0})))
    d = tmp_path / "ha"
    for bad in (dict(ttl_s=10**9), dict(ttl_s=0), dict(warmup_s=1e308)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be in"):
            HaMaster(str(d), MasterConfig(), etcd="127.0.0.1:1", name="m", candidate="c", **bad)
    assert not d.exists()
    threads = threading.active_count()
    for bad, why in ((1e300, f"in (0.0, {MAX_HEARTBEAT_S}]"), (0, f"in (0.0, {MAX_HEARTBEAT_S}]"),
                     (float("inf"), "finite"), (float("nan"), "finite")):
        with pytest.raises(ValueError, match=re.escape(f"heartbeat_s={float(bad)} must be {why}")):
            PoolNode("tcp://127.0.0.1:1", dram_bytes=1 << 20, heartbeat_s=bad)
    assert threading.active_count() == threads


_BROKEN_TIMER = """
import sys
import quillcache.master.server as server
from quillcache.cli import OneLineParser
from quillcache.cli.master import configure

parser = OneLineParser(prog="master")
configure(parser)
args = parser.parse_args(["--data-dir", sys.argv[1]])
server._check_durations = lambda args: None  # a caller that skips the checks: the timer's wait overflows
args.tick_s = 1e308
sys.exit(server.run_server(args))
"""


def test_a_timer_thread_that_breaks_stops_the_master(tmp_path):
    res = subprocess.run([sys.executable, "-c", _BROKEN_TIMER, str(tmp_path / "d")], capture_output=True, text=True,
                         cwd=ROOT, env=_env(), timeout=EXIT_DEADLINE_S)
    assert json.loads(res.stdout)["role"] == "single"  # it served, then stopped
    assert res.returncode == 1, res.stderr[-2000:]
    assert "quillcache master: the timer thread failed (OverflowError" in res.stderr



_HOLDER = (  # holds <dir>/master.lock with the pid given in argv[2] written in it, until stdin closes
    "import fcntl, os, sys\n"
    "fd = os.open(os.path.join(sys.argv[1], 'master.lock'), os.O_RDWR | os.O_CREAT, 0o644)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "os.ftruncate(fd, 0); os.pwrite(fd, (sys.argv[2] + '\\n').encode(), 0)\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n")


@contextlib.contextmanager
def _lock_holder(d, recorded_pid: int):
    """A process holding ``d``'s lock file with ``recorded_pid`` in it (as the snapshot writer forked by a master
    SIGKILLed just after the fork holds its copy, its dead parent's pid in the file); stopped on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(d), str(recorded_pid)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _exited_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_lock_kept_by_a_child_of_an_exited_holder_is_waited_for(tmp_path, monkeypatch):
    """The recorded holder has exited and a process it forked still has the file open: the new holder polls
    instead of refusing, and gets the lock once that process lets go. The first poll's wait is where it lets
    go, so the first try always finds the lock held."""
    import quillcache.durability.dirlock as datadir

    d = tmp_path / "m"
    d.mkdir()
    with _lock_holder(d, _exited_pid()) as child:
        waits = []

        def child_lets_go(seconds):
            waits.append(seconds)
            if child.poll() is None:
                child.stdin.close()
                child.wait(timeout=30)

        monkeypatch.setattr(datadir, "_sleep", child_lets_go)
        with DataDirLock(d) as lock:
            assert lock.held and waits


def test_a_live_holder_is_refused_at_once_and_a_child_past_the_grace_is_named(tmp_path, monkeypatch):
    import quillcache.durability.dirlock as datadir

    d = tmp_path / "m"
    d.mkdir()
    with _lock_holder(d, os.getppid()):  # a recorded holder that is running: refused without waiting
        monkeypatch.setattr(datadir, "_sleep", lambda s: pytest.fail("waited although the holder runs"))
        with pytest.raises(DataDirInUseError, match=f"pid {os.getppid()};") as ei:
            DataDirLock(d)
        assert not ei.value.holder_exited
    monkeypatch.undo()
    dead = _exited_pid()
    with _lock_holder(d, dead):  # a recorded holder that has exited, but its copy is never let go
        t0 = time.monotonic()
        with pytest.raises(DataDirInUseError, match=f"pid {dead}, which has exited, but a process it forked") as ei:
            DataDirLock(d, dead_holder_grace_s=0.2)
        assert ei.value.holder_exited and time.monotonic() - t0 >= 0.2
