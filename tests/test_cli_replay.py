"""``quillcache replay`` end to end in a subprocess: a summary on success, one clear line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")


def line(ts: int, ids: list[int], isl: int | None = None, osl: int = 20) -> str:
    return json.dumps({"timestamp": ts, "input_length": isl if isl is not None else 512 * len(ids),
                       "output_length": osl, "hash_ids": ids})


def write(tmp: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    p = tmp / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def good_lines() -> list[str]:
    return [line(0, [0, 1, 2]), line(100, [0, 1, 2, 3]), line(200, [0, 4], isl=700), line(5000, [0, 1, 2, 3, 5])]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quillcache", "replay", *args], capture_output=True, text=True, check=False,
                          timeout=120)


def test_replay_prints_summary_and_writes_results(tmp_path: Path) -> None:
    trace = write(tmp_path, good_lines())
    out = tmp_path / "out"
    p = cli(str(trace), "--out", str(out), "--engines", "2", "--model", "llama-3.2-1b")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    assert "block hit rate" in p.stdout and "TTFT p50 / p99" in p.stdout and "goodput" in p.stdout
    rows = pd.read_csv(out / "requests.csv")
    summary = pd.read_csv(out / "replay.csv")
    assert len(rows) == 4 and list(rows["request_id"]) == [0, 1, 2, 3]
    assert summary.loc[0, "requests"] == 4
    # request 1 reuses the 3 blocks of request 0 (one engine or the other, or a peer)
    assert rows.loc[1, "hit_gpu"] + rows.loc[1, "hit_dram"] + rows.loc[1, "hit_peer"] == 3
    assert 0 < summary.loc[0, "block_hit_rate"] < 1
    # summary.csv follows the results schema: the researcher API reads it, parameters as typed columns
    from quillcache.results import read_summary

    tidy = read_summary("out", tmp_path)
    assert tidy.loc[tidy.metric == "block_hit_rate", "value"].item() == summary.loc[0, "block_hit_rate"]
    assert set(tidy["engines"]) == {2} and set(tidy["profile"]) == {"custom"}


def test_help_has_examples() -> None:
    p = cli("--help")
    assert p.returncode == 0
    assert "examples:" in p.stdout and "--capacity-blocks" in p.stdout and "--account-bytes" in p.stdout


def test_skip_malformed_lines_reports_them(tmp_path: Path) -> None:
    lines = good_lines()
    lines.insert(2, "{not json")
    trace = write(tmp_path, lines)
    p = cli(str(trace), "--on-error", "skip", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    assert "line 3" in p.stdout
    assert len(pd.read_csv(tmp_path / "o" / "requests.csv")) == 4


@pytest.mark.parametrize("case, args, needle", [
    ("missing", ["{tmp}/nope.jsonl"], "does not exist"),
    ("malformed", ["{bad}"], ":2:"),
    ("unsorted", ["{unsorted}"], "sorted by timestamp"),
    ("policy", ["{good}", "--policy", "nope"], "--policy: unknown policy 'nope'"),
    ("router", ["{good}", "--router", "nope"], "--router: unknown router 'nope'"),
    ("model", ["{good}", "--model", "gpt-9"], "--model: unknown model 'gpt-9'"),
    ("gpu", ["{good}", "--gpu", "tpu"], "--gpu: unknown GPU 'tpu'"),
    ("capacity", ["{good}", "--capacity-blocks", "0"], "--capacity-blocks=0"),
    ("capacity-neg", ["{good}", "--capacity-blocks", "-5"], "--capacity-blocks=-5"),
    ("not-int", ["{good}", "--engines", "two"], "invalid int value"),
])
def test_bad_input_is_one_clear_line(tmp_path: Path, case: str, args: list[str], needle: str) -> None:
    paths = {
        "tmp": str(tmp_path),
        "good": str(write(tmp_path, good_lines(), "good.jsonl")),
        "bad": str(write(tmp_path, [good_lines()[0], '{"timestamp": 1, "input_length": "x"}'], "bad.jsonl")),
        "unsorted": str(write(tmp_path, [line(100, [0]), line(50, [0, 1])], "unsorted.jsonl")),
    }
    out = tmp_path / "out"
    p = cli(*[a.format(**paths) for a in args], "--out", str(out))
    assert p.returncode != 0, case
    assert needle in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    assert not out.exists()  # nothing written on refused input


# ---- hostile use: every error one line naming the flag, Ctrl-C, bounds ----------------------------


@pytest.mark.parametrize("args, message", [
    (["--engines", "abc"], "argument --engines: invalid int value: 'abc'"),
    (["--slo-ttft-s", "inf"], "--slo-ttft-s=inf must be a finite number in (0, 1e+06]"),
    (["--slo-ttft-s", "0"], "--slo-ttft-s=0.0 must be a finite number"),
    (["--time-scale", "1e-300"], "--time-scale=1e-300 must be a finite number in [1e-06, 1e+06]"),
    (["--capacity-blocks", "0"], "--capacity-blocks=0 must be >= 1"),
])
def test_argument_errors_are_one_line_naming_the_flag(tmp_path: Path, args, message) -> None:
    trace = write(tmp_path, good_lines())
    p = cli(str(trace), "--out", str(tmp_path / "out"), *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and message in errors[0], p.stderr
    assert "usage:" not in p.stderr  # one line, not the whole usage block
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_is_refused_before_the_work(tmp_path: Path) -> None:
    trace = write(tmp_path, good_lines())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = cli(str(trace), "--out", str(blocker / "out"))
    assert p.returncode == 2 and f"--out {blocker / 'out'}: {blocker} is a file, not a folder" in p.stderr
    assert "requests from" not in p.stderr  # the trace was not even read


def test_json_errors_name_the_file_line_and_the_column_within_it(tmp_path: Path) -> None:
    trace = write(tmp_path, [line(0, [0]), '{"timestamp": 2,'])
    p = cli(str(trace), "--out", str(tmp_path / "out"))
    assert p.returncode == 2
    assert f"{trace}:2: not valid JSON at column 17 (Expecting property name" in p.stderr
    assert "line 1 column" not in p.stderr


def test_a_huge_timestamp_is_one_skipped_line_not_the_rest_of_the_trace(tmp_path: Path) -> None:
    lines = good_lines()
    lines.insert(2, line(2**63 - 1, [7]))  # used to be accepted, then every later line was "earlier"
    trace = write(tmp_path, lines)
    p = cli(str(trace), "--out", str(tmp_path / "out"), "--on-error", "skip", "--quiet")
    assert p.returncode == 0, p.stderr
    assert pd.read_csv(tmp_path / "out" / "replay.csv").loc[0, "requests"] == 4
    p = cli(str(trace), "--out", str(tmp_path / "out2"))
    assert p.returncode == 2 and ":3: field 'timestamp'" in p.stderr and "too large" in p.stderr


def test_a_prompt_larger_than_the_gpu_is_stopped_or_skipped(tmp_path: Path) -> None:
    lines = good_lines() + [line(6000, list(range(100, 2100)))]  # 2,000 blocks of 512 tokens: 1M tokens
    trace = write(tmp_path, lines)
    p = cli(str(trace), "--out", str(tmp_path / "out"), "--gpu-capacity-blocks", "833")
    assert p.returncode == 2 and f"{trace}:5: needs 2,000 KV blocks" in p.stderr  # the file and its line
    assert "GPU holds 833" in p.stderr
    p = cli(str(trace), "--out", str(tmp_path / "out"), "--gpu-capacity-blocks", "833", "--on-error", "skip")
    assert p.returncode == 0 and "1 request(s) larger than an engine's GPU KV capacity were skipped" in p.stdout


def test_ctrl_c_is_one_line_exit_130_and_writes_nothing(tmp_path: Path) -> None:
    import os
    import select
    import signal
    import time

    lines = [line(i * 50, [i % 7, 1000 + i]) for i in range(20_000)]  # long enough to interrupt mid-replay
    trace = write(tmp_path, lines)
    out = tmp_path / "out"
    # Ctrl-C's default disposition in the child: a runner that started this suite as a background job of a
    # non-interactive shell passes SIGINT down as ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-m", "quillcache", "replay", str(trace), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while "requests from" not in seen:  # the replay has started (its first line), not a fixed sleep
            assert time.monotonic() < deadline, "replay did not start"
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                seen += os.read(proc.stderr.fileno(), 4096).decode()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = seen + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted" in err and not out.exists()


def test_a_billion_declared_blocks_cost_memory_for_what_is_used(tmp_path: Path) -> None:
    """--capacity-blocks 10**9 and --ssd-capacity-blocks 10**12 used to build allocators for all of it."""
    trace = write(tmp_path, good_lines())
    # a fresh parent process, so its children's peak RSS is the replay's alone
    wrapper = ("import resource, subprocess, sys; "
               "rc = subprocess.run([sys.executable, '-m', 'quillcache', 'replay', *sys.argv[1:]]).returncode; "
               "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    p = subprocess.run([sys.executable, "-c", wrapper, str(trace), "--out", str(tmp_path / "out"),
                        "--capacity-blocks", str(10**9), "--ssd-capacity-blocks", str(10**12), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    rc, peak_kib = map(int, p.stdout.split()[-2:])
    assert rc == 0, p.stderr
    assert peak_kib < 1 << 20, f"peak RSS {peak_kib / 1024:.0f} MiB"  # under 1 GiB


def test_a_ten_megabyte_line_is_refused_in_seconds(tmp_path: Path) -> None:
    import time

    ids = list(range(1_200_000))
    trace = write(tmp_path, [json.dumps({"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1,
                                         "hash_ids": ids})])
    assert trace.stat().st_size > 9_000_000
    t0 = time.monotonic()
    p = cli(str(trace), "--out", str(tmp_path / "out"))
    assert p.returncode == 2 and "needs 1,200,000 KV blocks" in p.stderr
    assert time.monotonic() - t0 < 60  # the acceptance bound (it takes about a second); was > 5 minutes


def test_a_long_trace_slowed_down_is_refused_and_a_late_one_stays_exact(tmp_path: Path) -> None:
    # arrivals 10**12 ms apart at --time-scale 1e-6 would be 1e15 s apart, where a float's step is
    # 0.125 s: a TTFT used to come out 0.0 despite a 50 ms prefill
    t = 10**12
    trace = write(tmp_path, [line(0, [0, 1, 2]), line(100, [10, 11]), line(t, [20, 21, 22])])
    p = cli(str(trace), "--out", str(tmp_path / "out"), "--time-scale", "1e-6")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--time-scale=1e-06: the trace's 1000000000000 ms from first to last arrival become 1e+15 s" in p.stderr
    assert not (tmp_path / "out").exists()
    # a trace that starts late (near the schema's bound) is timed from its first arrival: exact
    late = write(tmp_path, [line(t - 5000, [0, 1, 2]), line(t - 4900, [10, 11]), line(t, [20, 21, 22])], "late.jsonl")
    p = cli(str(late), "--out", str(tmp_path / "late"), "--quiet")
    assert p.returncode == 0, p.stderr
    rows = pd.read_csv(tmp_path / "late" / "requests.csv")
    assert (rows["ttft_s"] >= rows["prefill_s"] - 1e-6).all() and (rows["ttft_s"] > 0).all()  # microsecond-exact


# ---- --kv-codec: quantized DRAM/SSD tiers -------------------------------------------------------------


def test_kv_codec_replay_names_the_codec_and_reports_hits_ttft_and_bytes(tmp_path: Path) -> None:
    trace = write(tmp_path, good_lines())
    runs = {}
    for codec in ("fp16", "int8"):
        out = tmp_path / codec
        p = cli(str(trace), "--out", str(out), "--engines", "2", "--model", "llama-3.2-1b", "--kv-codec", codec,
                "--capacity-blocks", "4", "--ssd-capacity-blocks", "0")
        assert p.returncode == 0, p.stderr
        text = " ".join(p.stdout.split())  # the table may wrap its title
        assert f"KV codec {codec}" in text and "TTFT p90" in text and "fetched DRAM / SSD / peer" in text
        runs[codec] = pd.read_csv(out / "replay.csv").loc[0]
    f, q = runs["fp16"], runs["int8"]
    assert f.kv_codec == "fp16" and q.kv_codec == "int8"
    assert q.dram_capacity_bytes == f.dram_capacity_bytes and q.dram_capacity_blocks > f.dram_capacity_blocks
    assert q.tier_block_bytes < 0.55 * f.tier_block_bytes
    assert q.block_hit_rate >= f.block_hit_rate
    for col in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "bytes_offloaded_gpu_to_dram", "bytes_fetched_dram"):
        assert col in q.index
    from quillcache.results import read_summary

    tidy = read_summary("int8", tmp_path)
    assert set(tidy["kv_codec"]) == {"int8"}


@pytest.mark.parametrize("args, message", [
    (["--kv-codec", "int3"], "--kv-codec='int3' is not a KV codec; known: fp16, int8, fp8_e4m3, int4, int2"),
    (["--dram-capacity-bytes", "0"], "--dram-capacity-bytes=0 must be >= 1"),
    (["--ssd-capacity-bytes", "-5"], "--ssd-capacity-bytes=-5 must be >= 0"),
    (["--kv-codec", "int8", "--dram-capacity-bytes", "4096"], "holds no block"),
])
def test_kv_codec_errors_are_one_line(tmp_path: Path, args, message) -> None:
    trace = write(tmp_path, good_lines())
    p = cli(str(trace), "--out", str(tmp_path / "out"), "--model", "llama-3.2-1b", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and message in errors[0], p.stderr
    assert not (tmp_path / "out").exists()
