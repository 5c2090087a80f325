"""``quillcache.cluster.tempdirs``: a directory names its owner; a sweep removes exactly those whose owner is gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quillcache.cluster.tempdirs import (OWNER_FILE, make_owned_dir, owner_of, process_identity, running,
                                 sweep_stale_dirs)

PREFIX = "qc-test-owned-"


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is ``tmp_path`` for the test (make_owned_dir puts its directories there)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _dead_identity():
    """The identity of a process that ran and has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ident = process_identity(proc.pid)
    finally:
        proc.communicate(b"")
    assert ident is not None
    return ident


def _owned_by(root, name, ident) -> object:
    d = root / (PREFIX + name)
    d.mkdir()
    (d / OWNER_FILE).write_text(json.dumps({"pid": ident[0], "start_ticks": ident[1], "boot_id": ident[2],
                                            "pid_ns": ident[3]}))
    (d / "data").write_bytes(b"x" * 100)
    return d


def test_an_owned_dir_names_this_process_and_is_kept_while_it_runs(tmp_root):
    d = make_owned_dir(PREFIX)
    assert d.parent == tmp_root and d.name.startswith(PREFIX)
    assert owner_of(d) == process_identity() and running(owner_of(d))
    assert not (d / (OWNER_FILE + ".tmp")).exists()
    assert sweep_stale_dirs(PREFIX) == [] and d.is_dir()


def test_the_sweep_removes_exactly_the_dirs_whose_owner_is_gone(tmp_root):
    me = process_identity()
    dead = _dead_identity()
    assert not running(dead)
    gone = _owned_by(tmp_root, "gone", dead)
    reused = _owned_by(tmp_root, "reused", (me[0], me[1] - 1, me[2], me[3]))  # this pid, another start: reused
    rebooted = _owned_by(tmp_root, "rebooted", (me[0], me[1], "another-boot", me[3]))
    mine = _owned_by(tmp_root, "mine", me)
    elsewhere = _owned_by(tmp_root, "other-ns", (dead[0], dead[1], dead[2], me[3] + 1))  # can't be told: kept
    unowned = tmp_root / (PREFIX + "unowned")  # being made right now, or not ours
    unowned.mkdir()
    garbled = tmp_root / (PREFIX + "garbled")
    garbled.mkdir()
    (garbled / OWNER_FILE).write_text('{"pid": "12"')
    wrong_types = tmp_root / (PREFIX + "types")
    wrong_types.mkdir()
    (wrong_types / OWNER_FILE).write_text(json.dumps({"pid": True, "start_ticks": 1, "boot_id": "b", "pid_ns": 1}))
    a_file = tmp_root / (PREFIX + "file")
    a_file.write_bytes(b"not a dir")
    other_prefix = _owned_by(tmp_root, "x", dead).rename(tmp_root / "someone-else")

    removed = sweep_stale_dirs(PREFIX)
    assert sorted(removed) == sorted([gone, reused, rebooted])
    assert not any(p.exists() for p in removed)
    for kept in (mine, elsewhere, unowned, garbled, wrong_types, a_file, other_prefix):
        assert kept.exists(), kept
    assert sweep_stale_dirs(PREFIX) == []  # nothing left to sweep


def test_a_sweep_of_a_bad_prefix_is_refused(tmp_root):
    for bad in ("", "a/b"):
        with pytest.raises(ValueError, match="prefix must be a non-empty file name prefix"):
            sweep_stale_dirs(bad)
    assert sweep_stale_dirs(PREFIX, root=tmp_root / "missing") == []
