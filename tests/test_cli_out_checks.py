"""``--out`` of ``replay`` and ``hitrate`` is checked before any work (rev-kvquant findings 1 and 2).

1. An ``OSError`` while looking at ``--out`` (a name too long, no permission) is one line and exit 2,
   never a traceback.
2. What would only fail once the results are written is refused up front: a dangling or looping
   symbolic link on the path, a folder name longer than the file system takes, a path too long for the
   result files, a folder where a result file goes. Nothing is left behind, and the trace is not even
   read (no "N requests" line).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from quillcache.cli import main

COMMANDS = ["replay", "hitrate"]


def _trace(tmp_path: Path) -> Path:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 2,
                                         "hash_ids": [1, 2 + i]}) + "\n" for i in range(4)))
    return trace


def _refused(command: str, trace: Path, out: str, capsys) -> str:
    """Run ``command`` (progress lines on) with ``--out out``: exit 2 and exactly one line, which is returned."""
    assert main([command, str(trace), "--out", out]) == 2
    captured = capsys.readouterr()
    # one line: not even the "N requests from TRACE" line that reading the trace prints first
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith(f"quillcache {command}: error: --out ")
    return captured.err[:-1]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_name_too_long_to_look_at_is_one_line_not_a_traceback(command, tmp_path, monkeypatch, capsys):
    trace = _trace(tmp_path)
    monkeypatch.chdir(tmp_path)
    # was: OSError: [Errno 36] File name too long, a traceback and exit status 1
    line = _refused(command, trace, "a" * 300, capsys)
    assert line.endswith(": File name too long"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


def _refusing(real, refused: str):
    def call(path, *args, **kwargs):
        if os.fspath(path) == refused:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), refused)
        return real(path, *args, **kwargs)
    return call


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_that_may_not_be_searched_is_one_line(command, tmp_path, monkeypatch, capsys):
    trace = _trace(tmp_path)
    out = tmp_path / "locked" / "out"
    # what a non-root user sees under a folder without search permission: stat and lstat both refuse
    for name in ("stat", "lstat"):
        monkeypatch.setattr(os, name, _refusing(getattr(os, name), str(out)))
    assert _refused(command, trace, str(out), capsys) == \
        f"quillcache {command}: error: --out {out}: Permission denied"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("out,message", [
    ("dangling", "dangling is a symbolic link to nothing, not a folder"),
    ("dangling/sub", "dangling is a symbolic link to nothing, not a folder"),
    ("loop", "loop is a symbolic link that loops, not a folder"),
    ("loop/sub/deeper", "loop is a symbolic link that loops, not a folder"),
    ("new/" + "a" * 300, "is 300 bytes, longer than the"),
    ("b/" * 2030 + "out", "the path is too long for its result files"),
], ids=["dangling", "under-dangling", "loop", "under-loop", "long-new-name", "long-path"])
def test_an_out_that_could_never_be_written_is_refused_before_any_work(command, out, message, tmp_path,
                                                                       monkeypatch, capsys):
    trace = _trace(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dangling").symlink_to("nonexistent_target")
    (tmp_path / "loop").symlink_to("loop")
    before = sorted(p.name for p in tmp_path.iterdir())
    # was: the whole run, then "error: cannot write results under dangling: File exists"
    line = _refused(command, trace, out, capsys)
    assert message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made, nothing followed


@pytest.mark.parametrize("command,result_file", [("replay", "requests.csv"), ("replay", "pool.csv"),
                                                 ("hitrate", "hitrate.csv"), ("hitrate", "anatomy.csv")])
def test_a_folder_where_a_result_file_goes_is_refused_before_any_work(command, result_file, tmp_path, capsys):
    trace = _trace(tmp_path)
    out = tmp_path / "out"
    (out / result_file).mkdir(parents=True)
    line = _refused(command, trace, str(out), capsys)
    assert line == (f"quillcache {command}: error: --out {out}: result file {result_file} is a folder, not a file "
                    f"(the files there are as they were)"), line
    assert [p.name for p in out.iterdir()] == [result_file]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_symlink_to_a_folder_and_new_nested_folders_still_take_the_results(command, tmp_path, capsys):
    trace = _trace(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    assert main([command, str(trace), "--out", str(tmp_path / "link" / "a" / "b"), "--quiet"]) == 0
    capsys.readouterr()
    assert (tmp_path / "real" / "a" / "b" / "summary.csv").is_file()
