"""``quillcache.cluster.tempdirs``: a directory names the processes using it; a sweep removes exactly those that
every named process has left, and keeps whatever it cannot tell."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import quillcache.cluster.tempdirs as td
from quillcache.cluster.tempdirs import (OWNER_FILE, OWNER_FILE_MAX_BYTES, SWEPT_MARK, ProcessIdentity, add_user,
                                        make_owned_dir, owners_of, process_identity, running, sweep_stale_dirs)

PREFIX = "qc-test-owned-"
_SLEEPER = "import sys; sys.stdin.read()"  # runs until its stdin closes


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is ``tmp_path`` for the test (make_owned_dir puts its directories there)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.fixture
def child():
    """Start processes that run until the test ends (then they are stopped and reaped)."""
    procs: list[subprocess.Popen] = []

    def start(code: str = _SLEEPER) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        return procs[-1]

    try:
        yield start
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _dead_identity(child) -> ProcessIdentity:
    """The identity of a process that ran and has exited (and been reaped)."""
    proc = child()
    ident = process_identity(proc.pid)
    proc.kill()
    proc.wait()
    assert ident is not None and not running(ident)
    return ident


def _owned_by(root: Path, name: str, *idents: ProcessIdentity) -> Path:
    d = root / (PREFIX + name)
    d.mkdir()
    (d / OWNER_FILE).write_text(json.dumps({"processes": [dataclasses.asdict(i) for i in idents]}))
    (d / "sub").mkdir()
    (d / "sub" / "data").write_bytes(b"x" * 100)
    return d


def test_an_owned_dir_names_this_process_and_is_kept_while_it_runs(tmp_root):
    d = make_owned_dir(PREFIX)
    assert d.parent == tmp_root and d.name.startswith(PREFIX)
    assert owners_of(d) == [process_identity()] and running(process_identity())
    assert sorted(os.listdir(d)) == [OWNER_FILE]  # no temporary file left
    assert sweep_stale_dirs(PREFIX) == [] and d.is_dir()


def test_a_failed_owner_file_write_leaves_no_directory(tmp_root, monkeypatch):
    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(td.os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        make_owned_dir(PREFIX)
    assert list(tmp_root.iterdir()) == []


@pytest.mark.timeout(120)  # a blocking read of the fifo below would hang, not fail
def test_the_sweep_removes_exactly_the_dirs_every_named_process_has_left(tmp_root, child):
    me = process_identity()
    dead = _dead_identity(child)
    alive = process_identity(child().pid)
    gone = _owned_by(tmp_root, "gone", dead)
    reused = _owned_by(tmp_root, "reused", dataclasses.replace(me, start_ticks=me.start_ticks - 1))
    rebooted = _owned_by(tmp_root, "rebooted", dataclasses.replace(me, boot_id="an-earlier-boot"))
    target = _owned_by(tmp_root, "x", dead).rename(tmp_root / "not-ours")  # stale, but not under the prefix
    all_gone = _owned_by(tmp_root, "all-gone", dead, dataclasses.replace(dead, start_ticks=dead.start_ticks + 1))
    kept = {
        "mine": _owned_by(tmp_root, "mine", me),
        "a child still runs": _owned_by(tmp_root, "child-runs", dead, alive),
        "another pid namespace": _owned_by(tmp_root, "pid-ns", dataclasses.replace(dead, pid_ns=me.pid_ns + 1)),
        "another time namespace": _owned_by(tmp_root, "time-ns", dataclasses.replace(dead, time_ns=me.time_ns + 1)),
        "another machine": _owned_by(tmp_root, "machine", dataclasses.replace(dead, machine="elsewhere",
                                                                                 boot_id="its-boot")),
        "an unknown machine": _owned_by(tmp_root, "no-machine", dataclasses.replace(dead, machine="",
                                                                                    boot_id="its-boot")),
    }
    for name, text in {"unowned": None, "garbled": '{"processes": [', "empty": '{"processes": []}',
                       "bool pid": json.dumps({"processes": [{**dataclasses.asdict(dead), "pid": True}]}),
                       "extra key": json.dumps({"processes": [{**dataclasses.asdict(dead), "x": 1}]}),
                       "deep": "[" * 100_000,
                       "huge": json.dumps({"processes": [dataclasses.asdict(dead)]}) + " " * OWNER_FILE_MAX_BYTES,
                       }.items():
        d = tmp_root / (PREFIX + name.replace(" ", "-"))
        d.mkdir()
        if text is not None:
            (d / OWNER_FILE).write_text(text)
        kept[name] = d
    fifo = tmp_root / (PREFIX + "fifo")  # reading it would block the sweep
    fifo.mkdir()
    os.mkfifo(fifo / OWNER_FILE)
    kept["a fifo for an owner file"] = fifo
    linked = tmp_root / (PREFIX + "linked-owner")  # followed, it would name whatever the link points at
    linked.mkdir()
    (linked / OWNER_FILE).symlink_to(target / OWNER_FILE)
    kept["a symlinked owner file"] = linked
    (tmp_root / (PREFIX + "symlink")).symlink_to(target)
    kept["a symlink to a stale dir"] = tmp_root / (PREFIX + "symlink")
    kept["another prefix"] = target
    a_file = tmp_root / (PREFIX + "file")
    a_file.write_bytes(b"not a dir")
    kept["a file"] = a_file

    removed = sweep_stale_dirs(PREFIX)
    assert sorted(removed) == sorted([gone, reused, rebooted, all_gone])
    assert not any(os.path.lexists(p) for p in removed)
    for why, path in kept.items():
        assert os.path.lexists(path), why
    assert (target / "sub" / "data").exists()  # not reached through the symlink
    assert not [p for p in tmp_root.iterdir() if SWEPT_MARK in p.name]
    assert sweep_stale_dirs(PREFIX) == []  # nothing left to sweep


def test_a_removal_cut_short_is_finished_by_the_next_sweep(tmp_root, child, monkeypatch):
    import shutil

    stale = _owned_by(tmp_root, "stale", _dead_identity(child))
    real_rmtree = shutil.rmtree

    def cut_short(path, ignore_errors=False):  # removes the owner file, then fails on the rest
        os.unlink(Path(path) / OWNER_FILE)

    monkeypatch.setattr(td.shutil, "rmtree", cut_short)
    assert sweep_stale_dirs(PREFIX) == [stale] and not stale.exists()
    [tomb] = [p for p in tmp_root.iterdir()]
    assert tomb.name.startswith(PREFIX + SWEPT_MARK) and (tomb / "sub" / "data").exists()
    monkeypatch.setattr(td.shutil, "rmtree", real_rmtree)
    assert sweep_stale_dirs(PREFIX) == [] and list(tmp_root.iterdir()) == []  # no owner file, removed anyway


def test_children_added_as_users_hold_the_dir_until_they_exit(tmp_root, child):
    d = make_owned_dir(PREFIX)
    worker = child()
    assert add_user(d, worker.pid) and add_user(d, worker.pid)  # the second adds nothing
    me = process_identity()
    assert owners_of(d) == [me, process_identity(worker.pid)]
    (d / OWNER_FILE).write_text(json.dumps({"processes": [dataclasses.asdict(_dead_identity(child)),
                                                          dataclasses.asdict(process_identity(worker.pid))]}))
    assert sweep_stale_dirs(PREFIX) == [] and d.is_dir()  # its first user is gone, the worker is not
    worker.stdin.close()
    worker.wait(timeout=30)
    assert sweep_stale_dirs(PREFIX) == [d]
    gone = child()
    gone.kill()
    gone.wait()
    d2 = make_owned_dir(PREFIX)
    assert not add_user(d2, gone.pid) and owners_of(d2) == [me]  # an exited process cannot be named
    assert not add_user(tmp_root, os.getpid())  # no owner file there: nothing written
    assert not (tmp_root / OWNER_FILE).exists()


def test_a_zombie_and_a_process_with_a_non_utf8_name_are_told_apart(child):
    odd = child("import sys\nopen('/proc/self/comm', 'wb').write(b'\\xd0\\xb0 ) Z 1 \\xd0')\n"
                "print('renamed', flush=True)\nsys.stdin.read()")
    assert odd.stdout.readline() == b"renamed\n"  # the child says when it has renamed itself
    assert b")" in Path(f"/proc/{odd.pid}/comm").read_bytes()
    ident = process_identity(odd.pid)
    assert ident is not None and running(ident)  # a name with spaces, ')' and broken UTF-8 still parses
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        ident = process_identity(zombie.pid)
        assert ident is not None and not running(ident)
    finally:
        zombie.wait()


def test_a_sweep_of_a_bad_prefix_is_refused(tmp_root):
    for bad in ("", "a/b", ".", ".."):
        with pytest.raises(ValueError, match="prefix must be a non-empty file name prefix"):
            sweep_stale_dirs(bad)
    assert sweep_stale_dirs(PREFIX, root=tmp_root / "missing") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory that belongs to another user")
def test_another_users_dir_is_never_swept(tmp_root, child):
    theirs = _owned_by(tmp_root, "theirs", _dead_identity(child))
    os.chown(theirs, 65534, 65534)
    assert sweep_stale_dirs(PREFIX) == [] and theirs.is_dir()


@pytest.mark.parametrize("unknown", ["no /proc of its own", "no boot id", "no namespace", "unreadable entry",
                                     "no machine id"])
def test_what_cannot_be_told_is_kept(tmp_root, child, monkeypatch, unknown):
    dead = _dead_identity(child)
    if unknown == "no machine id":  # an earlier boot can be told from another host's only by the machine
        dead = dataclasses.replace(dead, boot_id="an-earlier-boot")
    stale = _owned_by(tmp_root, "stale", dead)

    def unreadable(entry):
        raise td._Unknown("EACCES")

    patch = {"no /proc of its own": ("_proc_is_ours", lambda: False), "no boot id": ("_boot_id", lambda: None),
             "no namespace": ("_ns_inode", lambda kind: None), "no machine id": ("_machine", lambda: ""),
             "unreadable entry": ("_stat_start_and_state", unreadable)}[unknown]
    with monkeypatch.context() as m:
        m.setattr(td, *patch)
        assert sweep_stale_dirs(PREFIX) == [] and stale.is_dir()
    assert sweep_stale_dirs(PREFIX) == [stale]  # told, it goes


def test_a_failed_add_user_leaves_the_owner_file_as_it_was(tmp_root, child, monkeypatch):
    d = make_owned_dir(PREFIX)
    before = (d / OWNER_FILE).read_bytes()

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(td.os, "replace", full)
    assert not add_user(d, child().pid)
    assert (d / OWNER_FILE).read_bytes() == before and sorted(os.listdir(d)) == [OWNER_FILE]


def test_add_user_drops_the_processes_known_to_have_exited(tmp_root, child):
    d = make_owned_dir(PREFIX)
    for _ in range(3):  # restarts: each worker exits before the next is named
        worker = child()
        assert add_user(d, worker.pid)
        worker.kill()
        worker.wait()
    last = child()
    assert add_user(d, last.pid)
    assert owners_of(d) == [process_identity(), process_identity(last.pid)]


def test_a_tree_too_deep_to_remove_does_not_stop_the_sweep(tmp_root, child, monkeypatch):
    """On Pythons whose rmtree recurses, a tree nested deeper than the recursion limit raises
    RecursionError there (ignore_errors does not cover it): such a tombstone (or stale dir) is left,
    and the sweep goes on to the next."""
    tomb = tmp_root / (PREFIX + SWEPT_MARK + "0123456789abcdef")
    (tomb / "d").mkdir(parents=True)
    stale = _owned_by(tmp_root, "stale", _dead_identity(child))
    real_rmtree = td.shutil.rmtree

    def too_deep(path, ignore_errors=False):
        if Path(path) == tomb:
            raise RecursionError("maximum recursion depth exceeded")
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(td.shutil, "rmtree", too_deep)
    assert sweep_stale_dirs(PREFIX) == [stale] and not stale.exists()
    assert (tomb / "d").is_dir()  # left as it is, and no error
    look_alike = tmp_root / (PREFIX + SWEPT_MARK + "not-a-tombstone")  # no owner file: kept, not taken for one
    look_alike.mkdir()
    assert sweep_stale_dirs(PREFIX) == [] and look_alike.is_dir()
