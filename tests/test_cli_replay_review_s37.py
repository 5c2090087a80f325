"""The s37 CLI review of ``quillcache replay`` / ``hitrate``: an interrupt during the replay always gives
its exit status (M1), replay refuses what hitrate refuses (M2) and an output too long for the engine (M3),
trace-level refusals name FILE:LINE (L1), and a trace with no block reference is refused by both (L2)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_cli_replay import line, write
from test_cli_safety import _default_stop_signals  # SIGINT, SIGHUP, SIGTERM at default (nohup)

from quillcache.cli import main

pd = pytest.importorskip("pandas")

DEADLINE_S = 60


# ================================================================ M1: an interrupt inside the index's batch

# A replay whose residency index sends the signal to its own process at its AT-th batch and waits for it
# there: the handler raises inside ArtIndex._logged, which marks the index failed (the window the review hit
# at random delays).
_SIGNAL_IN_BATCH = textwrap.dedent("""
    import os, signal, sys, time
    from quillcache.index.art_index import ArtIndex

    sig, at = getattr(signal, sys.argv[1]), int(sys.argv[2])
    original = ArtIndex._apply
    calls = [0]

    def apply(self, batch):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), sig)
            deadline = time.monotonic() + 10  # the handler raises before this ends
            while time.monotonic() < deadline:
                time.sleep(0.001)
        return original(self, batch)

    ArtIndex._apply = apply
    from quillcache.cli import main
    sys.exit(main(["replay", sys.argv[3], "--out", sys.argv[4], "--quiet"]))
""")


def test_an_interrupt_inside_an_index_batch_exits_with_its_status_and_no_traceback(tmp_path: Path) -> None:
    """The index fails on the interrupt and refuses the data planes' flush at close: that error is
    logged as one line, never raised in place of the interrupt (exit 130 / 143 / 129, as documented)."""
    trace = write(tmp_path, [line(i * 50, [i % 7, 1000 + i]) for i in range(400)])  # about 430 batches
    rng = random.Random(37)
    statuses = {"SIGINT": (130, "interrupted"), "SIGTERM": (143, "stopped by SIGTERM"),
                "SIGHUP": (129, "stopped by SIGHUP")}
    for trial in range(6):
        sig = ("SIGINT", "SIGTERM", "SIGHUP")[trial % 3]
        at = rng.randint(1, 400)
        out = tmp_path / f"out{trial}"
        res = subprocess.run([sys.executable, "-c", _SIGNAL_IN_BATCH, sig, str(at), str(trace), str(out)],
                             capture_output=True, text=True, timeout=DEADLINE_S, preexec_fn=_default_stop_signals)
        status, word = statuses[sig]
        where = f"{sig} at batch {at}: rc={res.returncode}\n{res.stderr}"
        assert res.returncode == status, where
        assert "Traceback" not in res.stderr, where
        assert f"quillcache replay: {word}; no results were written under {out}" in res.stderr, where
        assert len(res.stderr.strip().splitlines()) <= 2, where  # the status line, and the close error's
        assert not out.exists(), where


def test_an_interrupt_wins_over_the_failed_index_flush_at_close(monkeypatch) -> None:
    """Deterministic: Ctrl-C inside an index batch (the index turns failed), then ``replay()``'s cleanup
    closes the data planes, whose flush raises IndexFailedError: the KeyboardInterrupt propagates, and
    every data plane is closed all the same."""
    from quillcache.harness.replay import replay
    from quillcache.harness.config import ReplayConfig
    from quillcache.index.art_index import ArtIndex
    from quillcache.store import StoreDataPlane
    from quillcache.traces.loader import TraceRequest

    reqs = [TraceRequest(i * 50, 1024, 20, (i % 7, 1000 + i)) for i in range(60)]
    original = ArtIndex._apply
    calls = [0]

    def apply(self, batch):
        calls[0] += 1
        if calls[0] == 30:
            raise KeyboardInterrupt
        return original(self, batch)

    closed: list[str] = []
    close = StoreDataPlane.close

    def close_and_note(self) -> None:
        closed.append(self.node)
        close(self)

    monkeypatch.setattr(ArtIndex, "_apply", apply)
    monkeypatch.setattr(StoreDataPlane, "close", close_and_note)
    with pytest.raises(KeyboardInterrupt):
        replay(reqs, ReplayConfig(engines=3))
    assert sorted(closed) == ["engine-0", "engine-1", "engine-2"]  # not only up to the first failing flush


# ================================================================ M2 + L1: one chain rule, named by its line


def test_replay_refuses_an_unchained_trace_as_hitrate_does_naming_file_and_line(tmp_path: Path, capsys) -> None:
    """Block 1 was cached after block 0 and is requested again at a request's start: replay used to count
    GPU hits there (exit 0) while hitrate refused the trace. Both refuse it now, with the same words and the
    file's line numbers (a blank line 1 and a blank line 3 make request indices and lines differ)."""
    trace = write(tmp_path, ["", line(0, [0, 1, 2, 3]), "", line(5000, [1, 2, 3])])
    out = tmp_path / "out"
    assert main(["replay", str(trace), "--out", str(out), "--quiet"]) == 2
    replay_err = capsys.readouterr().err.strip().splitlines()
    assert main(["hitrate", str(trace), "--out", str(out), "--quiet", "--capacities", "inf",
                 "--policies", "s3fifo"]) == 2
    hitrate_err = capsys.readouterr().err.strip().splitlines()
    same = (f"{trace}:4: hash ids are not prefix-chained: block id 1 at hash_ids[0] starts its request, but at its "
            f"first reference (line 2, hash_ids[1]) it follows id 0; ")
    assert len(replay_err) == 1 and replay_err[0].startswith(f"quillcache replay: error: {same}"), replay_err
    assert "a hit no engine could have" in replay_err[0]
    assert len(hitrate_err) == 1 and hitrate_err[0].startswith(f"quillcache hitrate: error: {same}"), hitrate_err
    assert not out.exists()


def test_an_id_twice_in_one_request_is_refused_by_replay_naming_its_line(tmp_path: Path, capsys) -> None:
    trace = write(tmp_path, [line(0, [5, 6]), line(10, [7, 7])])
    assert main(["replay", str(trace), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"quillcache replay: error: {trace}:2: hash ids are not prefix-chained: block id 7 at "
                          f"hash_ids[1] follows id 7"), err
    assert "it occurs twice on line 2" in err


def test_the_harness_refuses_an_unchained_trace_with_a_typed_error() -> None:
    from quillcache.harness.replay import UnchainedTraceError, replay
    from quillcache.traces.loader import TraceRequest

    reqs = [TraceRequest(0, 2048, 10, (0, 1, 2, 3)), TraceRequest(5000, 1536, 10, (1, 2, 3))]
    with pytest.raises(UnchainedTraceError, match=r"block id 1 \(request 1, position 0\) starts its request") as ei:
        replay(reqs)
    assert (ei.value.chain_break.request, ei.value.chain_break.first_request) == (1, 0)


def test_hitrate_skipped_lines_do_not_shift_the_line_it_names(tmp_path: Path, capsys) -> None:
    """A malformed line skipped (--on-error skip) before the break: the line named is still the file's."""
    trace = write(tmp_path, [line(0, [0, 1]), "{not json", line(10, [0, 2]), line(20, [1, 2])])
    assert main(["hitrate", str(trace), "--on-error", "skip", "--out", str(tmp_path / "out"), "--quiet",
                 "--capacities", "10", "--policies", "s3fifo"]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:4: hash ids are not prefix-chained: block id 1 at hash_ids[0] starts its request, but at its " \
           f"first reference (line 1, hash_ids[1]) it follows id 0" in err, err


def test_a_prompt_too_large_names_file_and_line_not_the_request_index(tmp_path: Path, capsys) -> None:
    trace = write(tmp_path, ["", line(0, [0, 1]), "", line(1, [5, 6, 7, 8])])
    assert main(["replay", str(trace), "--gpu-capacity-blocks", "3", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"quillcache replay: error: {trace}:4: needs 4 KV blocks of 512 tokens for its 2,048-token prompt, "
                   f"but an engine's GPU holds 3 (llama-3-8b on h100-sxm); skip such requests with --on-error skip")


# ================================================================ M3: the output is checked like the prompt


def test_an_output_larger_than_the_gpu_kv_is_refused_before_any_work_or_skipped(tmp_path: Path, capsys) -> None:
    """1,000,000 output tokens need 1,954 blocks of 512 tokens, against 833 on the GPU: the run used to
    exit 0 with its goodput collapsed by 42,000 s of decode."""
    good = [line(i * 100, [0, 1 + i]) for i in range(5)]
    trace = write(tmp_path, [*good[:2], line(150, [99], isl=512, osl=1_000_000), *good[2:]])
    out = tmp_path / "out"
    assert main(["replay", str(trace), "--out", str(out), "--quiet", "--gpu-capacity-blocks", "833"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"quillcache replay: error: {trace}:3: needs 1,954 KV blocks of 512 tokens for its "
                   f"1,000,000-token output, but an engine's GPU holds 833 (llama-3-8b on h100-sxm); skip such "
                   f"requests with --on-error skip")
    assert not out.exists()
    assert main(["replay", str(trace), "--out", str(out), "--quiet", "--gpu-capacity-blocks", "833",
                 "--on-error", "skip"]) == 0
    assert "1 request(s) larger than an engine's GPU KV capacity skipped" in capsys.readouterr().err
    rows = pd.read_csv(out / "requests.csv")
    assert rows["request_id"].tolist() == [0, 1, 3, 4, 5] and rows["finish_s"].max() < 10


def test_an_output_decoding_past_simulated_time_is_refused(tmp_path: Path, capsys) -> None:
    """With a GPU large enough for its KV, 2 billion output tokens would decode for ~10**11 s, past the
    2**32 s where simulated times lose microsecond precision: refused, naming the line and the bound."""
    trace = write(tmp_path, [line(0, [0, 1]), line(10, [7], isl=10, osl=2_000_000_000)])
    assert main(["replay", str(trace), "--out", str(tmp_path / "out"), "--quiet",
                 "--gpu-capacity-blocks", str(2**40)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"quillcache replay: error: {trace}:2: decodes its 2,000,000,000-token output until at "
                          f"least "), err
    assert "past 4.29e+09 s where times lose microsecond precision" in err


def test_a_cluster_replay_refuses_a_bad_trace_before_starting_its_pool(tmp_path: Path, capsys, monkeypatch) -> None:
    from quillcache.harness import cluster_pool

    def no_cluster(*args, **kwargs):
        raise AssertionError("the pool was started for a trace the replay refuses")

    monkeypatch.setattr(cluster_pool, "cluster_replay", no_cluster)
    trace = write(tmp_path, [line(0, [0, 1]), line(10, [7], isl=512, osl=1_000_000)])
    assert main(["replay", str(trace), "--out", str(tmp_path / "out"), "--quiet", "--cluster", "1"]) == 2
    assert f"{trace}:2: needs 1,954 KV blocks" in capsys.readouterr().err


# ================================================================ L2: no block reference, both commands refuse


def test_a_trace_with_no_block_reference_is_refused_by_hitrate_as_by_replay(tmp_path: Path, capsys) -> None:
    trace = write(tmp_path, [line(0, [], isl=0), line(10, [], isl=0)])
    out = tmp_path / "out"
    assert main(["replay", str(trace), "--out", str(out), "--quiet"]) == 2
    assert "no request was replayed" in capsys.readouterr().err
    assert main(["hitrate", str(trace), "--out", str(out), "--quiet", "--capacities", "10",
                 "--policies", "s3fifo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"quillcache hitrate: error: {trace}: no block reference to replay (none of its 2 request(s) "
                   f"has hash ids); nothing was written"]
    assert not out.exists()


def test_a_hit_rate_of_no_reference_is_nan_not_zero() -> None:
    import math

    from quillcache.hitrate import simulate
    from quillcache.hitrate.arrays import arrays_from_lists

    res = simulate(arrays_from_lists([[], []]), "lru", 4)
    assert res.total_blocks == 0 and math.isnan(res.hit_rate)


def test_the_automatic_byte_mode_counts_the_one_block_a_trace_without_full_blocks_still_allocates():
    """L3: with no full block the automatic choice counted 0 bytes and chose real bytes, then allocated one block
    per engine anyway (with 65,536-token blocks 8 GiB each) and refused to run for lack of RAM."""
    from quillcache.harness import ReplayConfig, replay
    from quillcache.traces.loader import TraceRequest

    reqs = [TraceRequest(timestamp_ms=100 * i, input_tokens=100, output_tokens=5, hash_ids=(i,)) for i in range(4)]
    res = replay(reqs, ReplayConfig(engines=2, real_bytes_budget_bytes=1))  # one block per engine is over it
    assert res.account_bytes  # before: False (0 bytes counted), real bytes allocated past the budget
    res.close()


def test_a_run_past_simulated_time_through_queueing_names_its_request(monkeypatch, tmp_path):
    """Round-2 re-review /tmp/s37/rr2 N4: the check inside the event loop (queueing adds up past what each request
    alone needs) raised a plain ValueError naming a 0-based index; it is now the same refusal as the up-front
    one, so the CLI names the trace's FILE:LINE."""
    import importlib

    from quillcache.cli.replay import trace_problem
    from quillcache.harness import ReplayConfig, replay
    from quillcache.traces.loader import TraceRequest, load_trace_report

    hr = importlib.import_module("quillcache.harness.replay")
    monkeypatch.setattr(hr, "MAX_SIMULATED_S", 2.0)  # each request alone ends within it; queued, the second does not
    reqs = [TraceRequest(timestamp_ms=0, input_tokens=512 * 60, output_tokens=4,
                         hash_ids=tuple(range(k * 100, k * 100 + 60))) for k in range(3)]
    with pytest.raises(hr.RequestTooLargeError) as info:
        replay(reqs, ReplayConfig(engines=1))
    assert info.value.request == 1 and "its queueing included" in info.value.reason
    trace = write(tmp_path, ["", line(0, list(range(60))), line(0, list(range(100, 160)))])
    _, report = load_trace_report(trace)
    assert trace_problem(trace, report, info.value).startswith(f"{trace}:3: has events at ")  # line 3 holds request 1
