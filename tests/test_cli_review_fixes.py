"""Regression tests for the CLI review's findings (M1-M3, L1-L4): each failed on the code before its fix.

Nothing here generates or allocates much: a run that the old code would let grow (gen-trace) runs in a
subprocess under a 1 GiB address-space limit, and the node and cluster checks replace what would allocate."""

from __future__ import annotations

import csv
import importlib
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.cli import main

AS_LIMIT = 1 << 30  # the address space a subprocess that the old code would let grow may take


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _cli(*args: str, stdout=subprocess.PIPE, limit: bool = False, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "quillcache", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, check=False, timeout=timeout, preexec_fn=_limited if limit else None)


def _line(ts: int, ids: list[int], isl: int | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": isl if isl is not None else 512 * len(ids),
                       "output_length": 20, "hash_ids": ids})


def _trace(tmp: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    p = tmp / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _good(n: int = 20) -> list[str]:
    return [_line(100 * i, [0, 1 + i]) for i in range(n)]


def _one_row(path: Path) -> dict[str, str]:
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 1
    return rows[0]


def _metric(summary: Path, metric: str) -> float:
    with open(summary, newline="", encoding="utf-8") as fh:
        values = [float(r["value"]) for r in csv.DictReader(fh) if r["metric"] == metric]
    assert len(values) == 1, f"{metric} rows in {summary}: {values}"
    return values[0]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ================================================================ M1: gen-trace sizes are bounded
# (the limits as literals, so that this fails on the code before them for the right reason, not an ImportError:
# sessions.MAX_TRACE_REQUESTS and MAX_TENANTS; test_limits_are_the_documented_ones pins them)
@pytest.mark.parametrize("args, flag, limit", [
    (("sessions", "--sessions", "100000000"), "--sessions", "1000000"),
    (("sessions", "--requests", "100000000"), "--requests", "1000000"),
    (("collision", "--requests", "1000000000", "--tenants", "1000"), "--requests", "1000000"),
])
def test_gen_trace_refuses_a_size_above_its_limit_naming_flag_and_limit(tmp_path: Path, args, flag, limit) -> None:
    out = tmp_path / "t.jsonl"
    p = _cli("gen-trace", args[0], "--out", str(out), *args[1:], limit=True)
    assert p.returncode == 2, p.stderr
    msg = _one_line(p.stderr)
    assert flag in msg and re.search(rf"(?<![\d,]){limit}(?![\d,])", msg), msg  # the limit, not a longer number
    assert not out.exists()


@pytest.mark.parametrize("workload, size", [("sessions", "--sessions"), ("collision", "--requests")])
def test_gen_trace_refuses_tenants_above_the_limit(tmp_path: Path, monkeypatch, capsys, workload, size) -> None:
    from quillcache.traces import collision, sessions

    def generated(*_args, **_kwargs):
        raise AssertionError("a trace of 200,000 tenants was generated")

    monkeypatch.setattr(sessions, "generate", generated)
    monkeypatch.setattr(collision, "generate", generated)
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", workload, "--out", str(out), size, "1000000", "--tenants", "200000"]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert "--tenants" in msg and re.search(r"(?<![\d,])100000(?![\d,])", msg), msg


def test_limits_are_the_documented_ones() -> None:
    from quillcache.traces.sessions import MAX_TENANTS, MAX_TRACE_REQUESTS

    assert (MAX_TRACE_REQUESTS, MAX_TENANTS) == (1_000_000, 100_000)


def test_gen_trace_help_states_the_limits() -> None:
    for workload in ("sessions", "collision"):
        text = " ".join(_cli("gen-trace", workload, "--help").stdout.split())
        assert "at most 1,000,000" in text and "at most 100,000" in text, text


def test_gen_trace_stops_at_the_memory_budget(tmp_path: Path, monkeypatch, capsys) -> None:
    from quillcache.cli import argtypes

    monkeypatch.setattr(argtypes, "available_memory_bytes", lambda: 4 << 20, raising=False)
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", "sessions", "--out", str(out), "--sessions", "1000"]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert "memory" in msg and "--sessions" in msg and "GiB" in msg, msg
    assert not out.exists()


def test_gen_trace_collision_refuses_what_the_memory_budget_cannot_hold(tmp_path: Path, monkeypatch, capsys) -> None:
    from quillcache.cli import argtypes

    monkeypatch.setattr(argtypes, "available_memory_bytes", lambda: 4 << 20, raising=False)
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", "collision", "--out", str(out), "--requests", "10000"]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert "memory" in msg and "--requests" in msg, msg
    assert not out.exists()


def test_gen_trace_memory_error_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from quillcache.traces import sessions

    def exhausted(*_args, **_kwargs):
        raise MemoryError

    monkeypatch.setattr(sessions, "generate", exhausted)
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", "sessions", "--out", str(out), "--sessions", "10"]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert "out of memory" in msg and "--sessions" in msg and not out.exists()


# ================================================================ M2: what --on-error skip left out is recorded
def test_replay_skipped_lines_are_in_the_files_and_on_stderr_with_quiet(tmp_path: Path) -> None:
    trace = _trace(tmp_path, _good() + ["garbage"] * 7)
    out = tmp_path / "out"
    p = _cli("replay", str(trace), "--on-error", "skip", "--quiet", "--out", str(out), "--model", "llama-3.2-1b")
    assert p.returncode == 0, p.stderr
    assert "7 malformed" in _one_line(p.stderr)
    row = _one_row(out / "replay.csv")
    assert (row["lines_skipped"], row["requests_skipped_oversize"], row["requests_skipped_empty"]) == ("7", "0", "0")
    assert _metric(out / "summary.csv", "lines_skipped") == 7.0


def test_replay_oversize_skips_are_in_the_files_and_on_stderr(tmp_path: Path) -> None:
    lines = [_line(100 * i, [0, 1 + i] if i % 2 else [0], isl=1000 if i % 2 else 500) for i in range(10)]
    trace = _trace(tmp_path, lines)
    out = tmp_path / "out"
    p = _cli("replay", str(trace), "--on-error", "skip", "--quiet", "--out", str(out), "--gpu-capacity-blocks", "1",
             "--model", "llama-3.2-1b")
    assert p.returncode == 0, p.stderr
    assert "5 request(s) larger" in _one_line(p.stderr)
    row = _one_row(out / "replay.csv")
    assert row["requests_skipped_oversize"] == "5" and row["requests"] == "5"
    assert _metric(out / "summary.csv", "requests_skipped_oversize") == 5.0


def test_replay_of_no_request_is_an_error(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [json.dumps({"timestamp": 0, "input_length": 0, "output_length": 0, "hash_ids": []})])
    out = tmp_path / "out"
    p = _cli("replay", str(trace), "--quiet", "--out", str(out), "--model", "llama-3.2-1b")
    assert p.returncode == 2, p.stderr
    msg = _one_line(p.stderr)
    assert "no request was replayed" in msg and "empty prompt" in msg, msg
    assert not (out / "replay.csv").exists()


def test_hitrate_skipped_lines_are_in_summary_and_on_stderr_with_quiet(tmp_path: Path) -> None:
    trace = _trace(tmp_path, _good() + ["garbage"] * 3)
    out = tmp_path / "out"
    p = _cli("hitrate", str(trace), "--on-error", "skip", "--quiet", "--out", str(out), "--capacities", "2")
    assert p.returncode == 0, p.stderr
    assert "3 malformed" in _one_line(p.stderr)
    assert _metric(out / "summary.csv", "lines_skipped") == 3.0


# ================================================================ M3: --dram against the memory available
def test_node_dram_above_available_memory_is_refused_before_allocating(monkeypatch, capsys) -> None:
    harness_replay = importlib.import_module("quillcache.harness.replay")  # (the package exports a function so named)
    from quillcache.pool import node as pool_node

    class NoAllocation:
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("the node was started (its DRAM allocated)")

    monkeypatch.setattr(harness_replay, "available_ram_bytes", lambda: 2 << 30)
    monkeypatch.setattr(pool_node, "PoolNode", NoAllocation)
    monkeypatch.setenv("QUILLCACHE_TRANSFER_SECRET", "0123456789abcdef0123")
    assert main(["node", "--master", "tcp://127.0.0.1:1", "--dram", "4GiB"]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert "--dram" in msg and "available" in msg, msg


def test_cluster_up_dram_times_nodes_above_available_memory_is_refused(monkeypatch, capsys) -> None:
    harness_replay = importlib.import_module("quillcache.harness.replay")  # (the package exports a function so named)
    from quillcache.pool import cluster as pool_cluster

    class NoStart:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def start(self) -> None:
            raise pool_cluster.ClusterError("the cluster was started")

        def close(self) -> None:
            pass

    monkeypatch.setattr(harness_replay, "available_ram_bytes", lambda: 2 << 30)
    monkeypatch.setattr(pool_cluster, "LocalCluster", NoStart)
    assert main(["cluster", "up", "--nodes", "4", "--dram", "512MiB"]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert "--dram" in msg and "--nodes" in msg and "available" in msg, msg


def test_cgroup_limit_lowers_the_available_memory(monkeypatch, tmp_path: Path) -> None:
    from quillcache.cli import argtypes
    harness_replay = importlib.import_module("quillcache.harness.replay")  # (the package exports a function so named)

    root = tmp_path / "cg"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "memory.max").write_text("1073741824\n")
    (root / "sub" / "memory.current").write_text("268435456\n")
    (root / "memory.max").write_text("max\n")
    fake = tmp_path / "self_cgroup"
    fake.write_text("0::/sub\n")
    real_path = Path
    monkeypatch.setattr(argtypes, "_CGROUP_ROOT", root)
    monkeypatch.setattr(argtypes, "Path", lambda p: fake if p == "/proc/self/cgroup" else real_path(p))
    monkeypatch.setattr(harness_replay, "available_ram_bytes", lambda: 8 << 30)
    assert argtypes.available_memory_bytes() == (1 << 30) - (256 << 20)
    # the usage counts the inactive file cache, which the kernel reclaims before it refuses memory (re-review M2:
    # a container whose usage is mostly page cache was told it had no room)
    (root / "sub" / "memory.current").write_text(str(1000 << 20) + "\n")
    (root / "sub" / "memory.stat").write_text(f"anon {200 << 20}\nfile {800 << 20}\ninactive_file {700 << 20}\n")
    assert argtypes.available_memory_bytes() == (1 << 30) - (300 << 20)


# ================================================================ L1: a reader that stops early
def _closed_pipe_run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte
    try:
        return subprocess.run([sys.executable, "-m", "quillcache", *args], stdout=write_end, stderr=subprocess.PIPE,
                              input=stdin, text=True, check=False, timeout=120)
    finally:
        os.close(write_end)


def test_hash_into_a_closed_pipe_exits_quietly() -> None:
    p = _closed_pipe_run("hash", stdin=" ".join(str(i) for i in range(64 * 1024)))
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_info_into_a_closed_pipe_exits_quietly_and_blames_no_module() -> None:
    p = _closed_pipe_run("info")
    assert p.returncode == 141 and p.stderr == "", p.stderr


def test_info_reports_a_module_ok_when_only_its_print_fails(monkeypatch) -> None:
    from quillcache.cli import info

    printed = []

    def flaky_print(text: str, *args, **kwargs) -> None:
        printed.append(text)
        if text.endswith(": ok"):
            raise BrokenPipeError

    monkeypatch.setattr(info, "fast_modules", lambda: ["json"])
    monkeypatch.setattr("builtins.print", flaky_print)
    with pytest.raises(BrokenPipeError):
        info.run(None)
    assert not any("NOT AVAILABLE" in t for t in printed), printed


# ================================================================ L2: conflicting flags
@pytest.mark.parametrize("args, named", [
    (("--no-stream", "--stream-port", "47112"), ("--no-stream", "--stream-port")),
    (("--port", "47111", "--stream-port", "47111"), ("--port", "--stream-port")),
    (("--name", "foo", "--ttl-s", "3"), ("--name", "--ttl-s", "--etcd")),
    (("--prefix", "/x"), ("--prefix", "--etcd")),
])
def test_master_refuses_conflicting_flags(tmp_path: Path, monkeypatch, capsys, args, named) -> None:
    from quillcache.master import server

    monkeypatch.setattr(server, "run_server", lambda a: 99)  # the old code went on to serve
    assert main(["master", "--data-dir", str(tmp_path / "d"), *args]) == 2
    msg = _one_line(capsys.readouterr().err)
    assert all(flag in msg for flag in named), msg


def test_master_defaults_still_filled_in(tmp_path: Path, monkeypatch) -> None:
    from quillcache.master import server

    seen = {}
    monkeypatch.setattr(server, "run_server", lambda a: seen.update(vars(a)) or 0)
    assert main(["master", "--data-dir", str(tmp_path / "d")]) == 0
    assert seen["stream_port"] == 0 and seen["ttl_s"] == 5 and seen["name"] == "master"
    assert main(["master", "--data-dir", str(tmp_path / "d"), "--no-stream"]) == 0
    assert seen["stream_port"] is None


@pytest.mark.parametrize("args, named", [
    (("--capacity-blocks", "100", "--dram-capacity-bytes", str(67108864 * 5000)),
     ("--capacity-blocks", "--dram-capacity-bytes")),
    (("--ssd-capacity-blocks", "0", "--ssd-capacity-bytes", "1000000000000"),
     ("--ssd-capacity-blocks", "--ssd-capacity-bytes")),
])
def test_replay_refuses_blocks_and_bytes_for_one_tier(tmp_path: Path, args, named) -> None:
    trace = _trace(tmp_path, _good(3))
    p = _cli("replay", str(trace), "--quiet", "--out", str(tmp_path / "out"), "--model", "llama-3.2-1b", *args)
    assert p.returncode == 2, p.stderr
    msg = _one_line(p.stderr)
    assert all(flag in msg for flag in named), msg
    assert not (tmp_path / "out").exists()


# ================================================================ L3: engine-sim integer flags are bounded
def test_engine_sim_huge_buffer_steps_is_refused_naming_the_flag() -> None:
    p = _cli("engine-sim", "--port", "0", "--kv-events", "tcp://127.0.0.1:0", "--kv-events-buffer-steps",
             "1000000000000000000000", timeout=60)
    assert p.returncode == 2, p.stderr
    assert "--kv-events-buffer-steps" in _one_line(p.stderr)


# ================================================================ L4: messages name the flag
def test_replay_messages_name_the_flag(tmp_path: Path) -> None:
    trace = _trace(tmp_path, _good(3))
    p = _cli("replay", str(trace), "--quiet", "--out", str(tmp_path / "o1"), "--dram-capacity-bytes", "1")
    assert p.returncode == 2 and _one_line(p.stderr).startswith("quillcache replay: error: --dram-capacity-bytes: ")
    p = _cli("replay", str(trace), "--quiet", "--out", str(tmp_path / "o2"), "--gpu-capacity-blocks", "1")
    msg = _one_line(p.stderr)
    assert p.returncode == 2 and "on_oversize" not in msg and "--on-error skip" in msg, msg


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch) -> None:
    # the re-review's L3: any BrokenPipeError (a socket's too) exited 141 with nothing said
    from quillcache.cli import COMMANDS, main
    from quillcache.cli import info as info_cmd

    def run(args):
        raise BrokenPipeError(32, "Broken pipe (a peer's socket)")

    monkeypatch.setattr(info_cmd, "run", run)
    assert COMMANDS["info"].load() is info_cmd
    with pytest.raises(BrokenPipeError, match="peer's socket"):
        main(["info"])
