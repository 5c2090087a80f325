"""Bad input and stop signals lose nothing: the CLI refuses what it must not overwrite, and SIGTERM,
SIGHUP or Ctrl-C stop every process a command started and leave no temporary file or folder.

Everything runs on 127.0.0.1 free ports; every process a test starts is stopped in ``finally``, and
every wait is a poll with a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from polling import wait_until

from quillcache.cli import main

DEADLINE_S = 30.0  # for a child to stop once signalled; a healthy run takes well under a second


_poll = wait_until  # the suite's deadline-bounded poll


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=DEADLINE_S)


# ================================================================ gen-trace --out


def _special_files(tmp: Path) -> dict[str, Path]:
    """A fifo, a folder, a socket, a symlink to the fifo and (when this user may) a character device."""
    made = {"fifo": tmp / "fifo", "folder": tmp / "folder", "socket": tmp / "sock", "symlink": tmp / "link"}
    os.mkfifo(made["fifo"])
    made["folder"].mkdir()
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(made["socket"]))
    finally:
        s.close()
    made["symlink"].symlink_to("fifo")
    try:
        os.mknod(tmp / "fakenull", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a stand-in for /dev/null
        made["device"] = tmp / "fakenull"
    except PermissionError:
        pass
    return made


def test_gen_trace_refuses_an_out_that_is_not_a_regular_file_and_leaves_it(tmp_path, capsys):
    made = _special_files(tmp_path)
    try:
        _check_refusals(tmp_path, made, capsys)
    finally:
        if "device" in made:  # a stand-in for /dev/null is not left lying around in a temporary folder
            made["device"].unlink()


def _check_refusals(tmp_path: Path, made: dict[str, Path], capsys) -> None:
    before = {kind: os.lstat(p) for kind, p in made.items()}
    words = {"fifo": "is a fifo", "folder": "is a directory", "socket": "is a socket", "symlink": "is a fifo",
             "device": "is a character device"}
    for kind, path in made.items():
        assert main(["gen-trace", "sessions", "--sessions", "2", "--out", str(path)]) == 2, kind
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {path}" in err and words[kind] in err, (kind, err)
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino, after.st_rdev) == \
               (before[kind].st_mode, before[kind].st_ino, before[kind].st_rdev), kind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in made.values())  # no temp file
    assert main(["gen-trace", "sessions", "--sessions", "2", "--out", ""]) == 2
    assert "--out '' names no file" in capsys.readouterr().err


def test_gen_trace_writes_through_a_symlink_and_keeps_it(tmp_path, capsys):
    target = tmp_path / "target.jsonl"
    target.write_text("OLD\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target.name)
    assert main(["gen-trace", "sessions", "--sessions", "2", "--out", str(link)]) == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_text().startswith('{"timestamp"')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "target.jsonl"]


def test_gen_trace_never_replaces_a_file_under_a_system_folder(tmp_path, monkeypatch, capsys):
    from quillcache.cli import gen_trace

    system = tmp_path / "dev"  # stands in for /dev: the test never writes to the real one
    system.mkdir()
    victim = system / "full"
    victim.write_text("KEEP\n")
    monkeypatch.setattr(gen_trace, "SYSTEM_DIRS", (system,))
    for out in (victim, system / "new", tmp_path / "link"):
        if out.name == "link":
            out.symlink_to(victim)
        assert main(["gen-trace", "sessions", "--sessions", "2", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"is under {system}, a system folder" in err and str(out) in err, err
    assert victim.read_text() == "KEEP\n" and sorted(p.name for p in system.iterdir()) == ["full"]


# A gen-trace whose writer sends a signal to its own process half-way through the temporary file.
_SIGNAL_WHILE_WRITING = textwrap.dedent("""
    import os, signal, sys, time
    from quillcache.traces import sessions

    def writer(reqs, path):
        with open(path, "w") as fh:
            fh.write("partial\\n")
            fh.flush()
            os.kill(os.getpid(), signal.{sig})
            deadline = time.monotonic() + 10  # the handler raises before this ends
            while time.monotonic() < deadline:
                time.sleep(0.01)

    sessions.write_jsonl = writer
    from quillcache.cli import main
    sys.exit(main(["gen-trace", "sessions", "--sessions", "2", "--out", sys.argv[1]]))
""")


@pytest.mark.parametrize("sig, status, word", [("SIGTERM", 143, "stopped by SIGTERM"),
                                               ("SIGHUP", 129, "stopped by SIGHUP"),
                                               ("SIGINT", 130, "interrupted")])
def test_gen_trace_stopped_while_writing_leaves_no_temp_file_and_says_so(tmp_path, sig, status, word):
    out = tmp_path / "trace.jsonl"
    out.write_text("OLD\n")
    res = subprocess.run([sys.executable, "-c", _SIGNAL_WHILE_WRITING.format(sig=sig), str(out)],
                         capture_output=True, text=True, timeout=DEADLINE_S, preexec_fn=_default_stop_signals)
    assert res.returncode == status, (res.returncode, res.stderr)
    assert f"{word}; nothing was written to {out} (it is as it was)" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert out.read_text() == "OLD\n"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.jsonl"]  # no .trace.jsonl.tmpPID


# ================================================================ cluster up / replay --cluster: children

MARK_ENV = "QUILLCACHE_TEST_MARK"  # set on the command a test starts; its children inherit it


def _marked_pids(mark: str) -> set[int]:
    """Live (not zombie) processes whose environment carries ``MARK_ENV=mark``: the command a test
    started and every process that command started."""
    want = f"{MARK_ENV}={mark}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if want in env and state != "Z":
            found.add(int(entry))
    return found


def _all_gone(mark: str) -> None:
    """Poll until no process carries ``mark``; name the survivors (pid, command line) otherwise."""
    try:
        _poll(lambda: not _marked_pids(mark), DEADLINE_S, "every child's exit")
    except AssertionError:
        left = {}
        for pid in _marked_pids(mark):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    left[pid] = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
        raise AssertionError(f"still running {DEADLINE_S} s after the signal: {left}") from None


def _kill_marked(mark: str) -> None:
    """After a failed test: SIGKILL what the command left behind (only processes carrying its mark)."""
    for pid in _marked_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_marked(argv: list[str], tmp: Path, mark: str) -> tuple[subprocess.Popen, Path]:
    """``python -m quillcache ARGV`` with its temporary files in a fresh folder (returned) and ``mark``."""
    tmpdir = tmp / "tmpdir"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), MARK_ENV: mark}
    proc = subprocess.Popen([sys.executable, "-m", "quillcache", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_stop_signals)
    return proc, tmpdir


def _default_stop_signals() -> None:
    """In the child, before exec: the default dispositions of the signals a test sends. A test run from a
    non-interactive shell (``nohup``, ``cmd &``) inherits SIGINT and SIGHUP ignored, and a command keeps an
    ignored stop signal ignored (as ``nohup`` asks), so the test would not be testing its handling."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _spawned_all(tmpdir: Path, nodes: int) -> bool:
    """True once a LocalCluster under ``tmpdir`` has started its master and ``nodes`` nodes (their logs)."""
    return any((d / f"node-{nodes - 1}.log").exists() for d in tmpdir.glob("quillcache-cluster-*"))


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import select

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc.stdout.readline()
    raise AssertionError(f"no line from {proc.args} within {timeout_s} s: {proc.stderr.read() if proc.poll() else ''}")


needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds children through /proc")


def test_cluster_up_refuses_more_nodes_than_the_shared_cap(monkeypatch, capsys):
    from quillcache.harness.cluster_pool import MAX_CLUSTER_NODES
    from quillcache.pool.cluster import MAX_NODES, LocalCluster

    def never(self):  # the refusal must come before any process starts
        raise AssertionError("LocalCluster.start was called")

    monkeypatch.setattr(LocalCluster, "start", never)
    for nodes in (MAX_NODES + 1, 10**6, 0):
        with pytest.raises(SystemExit) as e:
            main(["cluster", "up", "--nodes", str(nodes)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--nodes: '{nodes}' is not in [1, {MAX_NODES}]" in err, err
    with pytest.raises(ValueError, match=rf"\[1, {MAX_NODES}\]"):
        LocalCluster(MAX_NODES + 1)
    assert MAX_CLUSTER_NODES == MAX_NODES  # replay --cluster has the same bound


@needs_proc
def test_cluster_up_sigterm_while_starting_stops_what_was_started(tmp_path):
    mark = f"up-start-{os.getpid()}"
    proc, tmpdir = _start_marked(["cluster", "up", "--nodes", "2", "--dram", "16MiB"], tmp_path, mark)
    try:
        _poll(lambda: _spawned_all(tmpdir, 2) or proc.poll() is not None, DEADLINE_S, "the nodes' start")
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err)
        assert out == "" and "stopped by SIGTERM while starting; every process it started was stopped" in err, err
        _all_gone(mark)
        assert list(tmpdir.iterdir()) == []  # the quillcache-cluster-* folder was removed
    finally:
        _stop(proc)
        _kill_marked(mark)


@needs_proc
def test_cluster_up_sighup_while_serving_stops_every_child(tmp_path):
    import json

    mark = f"up-serve-{os.getpid()}"
    proc, tmpdir = _start_marked(["cluster", "up", "--nodes", "2", "--dram", "16MiB"], tmp_path, mark)
    try:
        line = json.loads(_read_line(proc, DEADLINE_S))
        children = _marked_pids(mark) - {proc.pid}
        assert {n["pid"] for n in line["nodes"]} <= children and len(children) == 3  # the master and 2 nodes
        proc.send_signal(signal.SIGHUP)  # as when the terminal closes
        assert proc.wait(timeout=DEADLINE_S) == 0, proc.stderr.read()
        _all_gone(mark)
        assert list(tmpdir.iterdir()) == []
    finally:
        _stop(proc)
        _kill_marked(mark)


@needs_proc
def test_replay_cluster_sigterm_stops_the_pool_and_removes_its_folder(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 2048, "output_length": 20,
                                         "hash_ids": [0, 1, 2, i + 3]}) + "\n" for i in range(20)))
    out = tmp_path / "out"
    mark = f"replay-{os.getpid()}"
    proc, tmpdir = _start_marked(["replay", str(trace), "--cluster", "2", "--out", str(out), "--quiet"], tmp_path,
                                 mark)
    try:
        _poll(lambda: _spawned_all(tmpdir, 2) or proc.poll() is not None, DEADLINE_S, "the pool's start")
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
        assert f"stopped by SIGTERM; no results were written under {out}" in err and "Traceback" not in err, err
        _all_gone(mark)
        assert list(tmpdir.iterdir()) == [] and not out.exists()
    finally:
        _stop(proc)
        _kill_marked(mark)


# ================================================================ replay: bounds and --out


def _small_trace(path: Path, n: int = 20) -> Path:
    import json

    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 2048, "output_length": 20,
                                        "hash_ids": [0, 1, 2, i + 3]}) + "\n" for i in range(n)))
    return path


# Every command line in one child (one import of the harness): prints "status<TAB>stderr" per line.
_RUN_ALL = textwrap.dedent("""
    import contextlib, io, json, sys
    from quillcache.cli import main
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as e:
                status = e.code
        print(json.dumps([status, err.getvalue()]), flush=True)
""")


def _run_all(argvs: list[list[str]], cwd: Path, timeout_s: float = 30.0) -> list[tuple[int, str]]:
    import json

    res = subprocess.run([sys.executable, "-c", _RUN_ALL, json.dumps(argvs)], capture_output=True, text=True,
                         cwd=cwd, timeout=timeout_s)
    assert res.returncode == 0, res.stderr
    return [tuple(json.loads(line)) for line in res.stdout.splitlines()]


def test_replay_refuses_huge_capacities_naming_the_flag(tmp_path):
    from quillcache.cli.argtypes import MAX_COUNT
    from quillcache.cli.replay import MAX_DRAM_BLOCKS

    trace = str(_small_trace(tmp_path / "t.jsonl"))
    huge = "99999999999999999999999"  # hung at 100% CPU setting up the DRAM tier
    cases = [("--capacity-blocks", huge, MAX_DRAM_BLOCKS),
             ("--capacity-blocks", str(MAX_DRAM_BLOCKS + 1), MAX_DRAM_BLOCKS),
             ("--ssd-capacity-blocks", huge, MAX_COUNT), ("--gpu-capacity-blocks", huge, MAX_COUNT),
             ("--dram-capacity-bytes", str(MAX_COUNT + 1), MAX_COUNT), ("--ssd-capacity-bytes", huge, MAX_COUNT),
             ("--limit", huge, MAX_COUNT)]
    got = _run_all([["replay", trace, flag, value, "--quiet", "--out", str(tmp_path / "out")]
                    for flag, value, _ in cases], cwd=tmp_path)
    for (flag, value, high), (status, err) in zip(cases, got, strict=True):
        assert status == 2 and err == f"quillcache replay: error: {flag}={value} must be <= {high}\n", (flag, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # nothing written


def test_replay_refuses_an_empty_out_and_writes_nowhere(tmp_path):
    trace = str(_small_trace(tmp_path / "t.jsonl"))
    got = _run_all([["replay", trace, "--out", text, "--quiet"] for text in ("", "  ")], cwd=tmp_path)
    for text, (status, err) in zip(("", "  "), got, strict=True):
        assert status == 2 and f"--out {text!r} names no folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no ./results/replay/t/


# ================================================================ cluster status input, --help


def _usage_error(argv: list[str]) -> None:
    """``main(argv)`` must refuse at parse time: argparse's exit, status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2, argv


@pytest.mark.parametrize("args, needle", [
    (["--master", "garbage"], "argument --master: 'garbage' is not an address"),
    (["--master", ""], "argument --master: '' is not an address"),
    (["--master", "tcp://127.0.0.1:99999"], "argument --master: 'tcp://127.0.0.1:99999' is not an address"),
    (["--master", "tcp://:5555"], "argument --master: 'tcp://:5555' is not an address"),
    (["--master", "tcp://127.0.0.1:1", "--timeout-s", "1e308"], "argument --timeout-s: '1e308' is not in (0, 3600]"),
    (["--master", "tcp://127.0.0.1:1", "--timeout-s", "nan"], "argument --timeout-s: 'nan' is not in (0, 3600]"),
])
def test_cluster_status_refuses_malformed_input_as_a_usage_error(args, needle, capsys):
    _usage_error(["cluster", "status", *args])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "did not answer" not in err, err


def test_cluster_status_accepts_every_address_form():
    from quillcache.cli import argtypes

    for text in ("tcp://127.0.0.1:5555", "127.0.0.1:5555", "qtcp://localhost:1", "tcp://[::1]:65535",
                 "tcp://node-7.example.org:80"):
        assert argtypes.address(text) == text


def test_help_says_what_a_user_must_know(capsys):
    def help_of(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0
        return " ".join(capsys.readouterr().out.split())  # unwrapped

    assert "QUILLCACHE_TRANSFER_SECRET is required" in help_of(["node"]) and "at least 16 bytes" in help_of(["node"])
    up = help_of(["cluster", "up"])
    assert "Start a master and N `quillcache node` processes (1..16)" in up and "SIGHUP" in up
    status = help_of(["cluster", "status"])
    assert "Ask the master at ADDR for its pool" in status and "(default 5)" in status


# ================================================================ replay: results written as one set


def _replay(trace: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quillcache", "replay", str(trace), "--out", str(out), "--quiet",
                           *extra], capture_output=True, text=True, timeout=DEADLINE_S)


def test_replay_refused_write_leaves_the_previous_set_as_it_was(tmp_path):
    trace = _small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "out"
    (out / "replay.csv").mkdir(parents=True)  # in the way of one file of the set
    for name in ("summary.csv", "requests.csv"):
        (out / name).write_text("OLD\n")
    res = _replay(trace, out)
    assert res.returncode == 2 and "replay.csv is a folder, not a file (the files there are as they were)" in \
        res.stderr, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["replay.csv", "requests.csv", "summary.csv"]  # no .replay-*
    assert (out / "requests.csv").read_text() == "OLD\n" and (out / "summary.csv").read_text() == "OLD\n"


def test_replay_removes_a_stale_file_of_an_earlier_run_and_keeps_others(tmp_path):
    trace = _small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    (out / "pool.csv").write_text("from an earlier --cluster run\n")
    (out / "notes.txt").write_text("mine\n")
    res = _replay(trace, out)
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in out.iterdir())
    assert "pool.csv" not in names and "notes.txt" in names and "replay.csv" in names and "summary.csv" in names
    assert not any(n.startswith(".replay-") for n in names)


_SIGTERM_WHILE_RENAMING = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    out = Path(sys.argv[2])
    real = os.replace

    def replace(src, dst):
        if Path(dst) == out / "requests.csv":  # the first rename into --out: SIGTERM arrives now
            os.kill(os.getpid(), signal.SIGTERM)
        return real(src, dst)

    os.replace = replace
    from quillcache.cli import main
    sys.exit(main(["replay", sys.argv[1], "--out", str(out), "--quiet"]))
""")


def test_replay_sigterm_while_renaming_takes_effect_once_the_set_is_in_place(tmp_path):
    trace = _small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    (out / "pool.csv").write_text("stale\n")
    res = subprocess.run([sys.executable, "-c", _SIGTERM_WHILE_RENAMING, str(trace), str(out)], capture_output=True,
                         text=True, timeout=DEADLINE_S)
    assert res.returncode == 128 + signal.SIGTERM, (res.returncode, res.stderr)
    assert f"stopped by SIGTERM; the results were written under {out} first" in res.stderr, res.stderr
    names = sorted(p.name for p in out.iterdir())
    assert {"requests.csv", "replay.csv", "summary.csv", "meta.json"} <= set(names) and "pool.csv" not in names
    assert not any(n.startswith(".replay-") for n in names)


# ================================================================ light start-up, Ctrl-C while configuring

_MODULES_AFTER = textwrap.dedent("""
    import json, sys
    from quillcache.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
    print(json.dumps(sorted(sys.modules)))
""")


def test_a_command_configures_only_itself_so_info_stays_light():
    import json

    res = subprocess.run([sys.executable, "-c", _MODULES_AFTER, "info", "--help"], capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert res.returncode == 0, res.stderr
    loaded = set(json.loads(res.stdout.splitlines()[-1]))
    heavy = {"numba", "quillcache.harness.config", "quillcache.harness.cluster_pool", "quillcache.pool.cluster",
             "quillcache.master.client", "pandas"}
    assert not heavy & loaded, sorted(heavy & loaded)


_CTRL_C_WHILE_CONFIGURING = textwrap.dedent("""
    import sys
    import quillcache.cli.replay as replay

    def configure(parser):  # as if Ctrl-C came while replay's configure imports the harness
        raise KeyboardInterrupt

    replay.configure = configure
    from quillcache.cli import main
    sys.exit(main(["replay", "t.jsonl"]))
""")


def test_ctrl_c_while_a_command_is_configured_is_one_line():
    res = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_CONFIGURING], capture_output=True, text=True,
                         timeout=DEADLINE_S)
    assert (res.returncode, res.stderr) == (130, "quillcache: interrupted\n")


# A stop signal that lands while Popen waits for a node's exec: the Popen object (and with it the
# child's pid) would be lost to the exception, leaving a node nobody stops. Simulated by a Popen that
# signals this process as it returns.
_SIGNAL_INSIDE_POPEN = textwrap.dedent("""
    import os, signal, subprocess, sys
    from quillcache.cli.signals import stop_signals_interrupt
    from quillcache.pool.cluster import LocalCluster

    class Popen(subprocess.Popen):
        def __init__(self, args, **kwargs):
            super().__init__(args, **kwargs)
            if "node" in args:
                os.kill(os.getpid(), signal.SIGTERM)

    subprocess.Popen = Popen
    with stop_signals_interrupt():
        try:
            LocalCluster(1, dram_bytes=16 << 20).start()
        except KeyboardInterrupt as exc:
            sys.exit(128 + exc.signum)
    sys.exit(0)
""")


@needs_proc
def test_a_stop_signal_while_a_node_is_spawned_loses_no_child(tmp_path):
    mark = f"popen-{os.getpid()}"
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), MARK_ENV: mark}
    try:
        res = subprocess.run([sys.executable, "-c", _SIGNAL_INSIDE_POPEN], capture_output=True, text=True, env=env,
                             timeout=DEADLINE_S)
        assert res.returncode == 128 + signal.SIGTERM, (res.returncode, res.stderr)
        _all_gone(mark)
        assert list(tmpdir.iterdir()) == []
    finally:
        _kill_marked(mark)


def test_a_stop_signal_ignored_at_start_stays_ignored():
    """``nohup quillcache cluster up &``: SIGHUP arrives ignored and must stay ignored (the user asked the
    command to outlive the terminal); SIGTERM, not ignored, is handled."""
    from quillcache.cli.signals import stop_signals_interrupt

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with stop_signals_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)
