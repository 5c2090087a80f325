"""Regression tests for the studies review of 2026-11-29 (experiments/), one per finding:

F1. the crash study's headline counts checks of acknowledged blocks, not distinct blocks, and says so;
F2. the DRAM store benchmark times its three subjects in reverse order on odd repetitions;
F4. a study entry point refuses a bad --index, --trace or --entries with one line and exit 2;
F5. every ``naive_unsafe_share`` row of the safety study has the hit blocks it is a share of as ``n``.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter

import pytest

from quillcache.results import read_summary
from tests.test_report_review_fixes import render, results_copy


def test_crash_headline_counts_checks_not_blocks(tmp_path):
    text = render("crash", results_copy(tmp_path, "crash"), "headline")
    assert "checks of acknowledged blocks" in text and "these count checks, not distinct blocks" in text
    assert "checked 367,750 acknowledged blocks" not in text and "not counted as crashes" in text


def test_store_bench_dram_alternates_the_order_of_its_subjects(tmp_path, monkeypatch):
    from experiments import store_bench_dram as sd

    order: list[str] = []
    memcpy_cell, store_cell = sd._memcpy_cell, sd._store_cell

    def memcpy(*a):
        order.append("memcpy")
        return memcpy_cell(*a)

    def store(st, keys, srcs, n, dst, verify):
        order.append("checked" if verify else "plain")
        return store_cell(st, keys, srcs, n, dst, verify)

    monkeypatch.setattr(sd, "_memcpy_cell", memcpy)
    monkeypatch.setattr(sd, "_store_cell", store)
    monkeypatch.setattr(sd, "SIZES", (1 << 20,))
    monkeypatch.setattr(sd, "QUICK", dict(reps=4, store_bytes=4 << 20, cell_bytes=4 << 20, source_bytes=2 << 20))
    with contextlib.redirect_stdout(io.StringIO()):
        sd.run(quick=True, results_root=str(tmp_path))
    timed = order[3:]  # after the untimed warm-up of all three
    assert order[:3] == ["memcpy", "plain", "checked"]
    assert [timed[i:i + 3] for i in range(0, 12, 3)] == [["memcpy", "plain", "checked"], ["checked", "plain", "memcpy"]] * 2


@pytest.mark.parametrize("module, argv, message", [
    ("safety_study", ["--quick", "--index", "bogus"], "--index 'bogus': unknown index backend"),
    ("replay_study", ["--quick", "--trace", "/nonexistent/t.jsonl"], "--trace: trace file /nonexistent/t.jsonl does not"),
    ("storage_study", ["--quick", "--entries", "1k"], "--entries '1k': comma-separated whole numbers"),
    ("storage_study", ["--quick", "--entries", "0"], "--entries '0': at least one target, each >= 1"),
])
def test_a_study_entry_point_refuses_bad_input_in_one_line(module, argv, message, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"experiments.{module}").main
    with pytest.raises(SystemExit) as info:
        main([*argv, "--results-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_replay_study_refuses_a_malformed_trace_in_one_line(tmp_path, capsys):
    from experiments import replay_study

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x"}\n')
    with pytest.raises(SystemExit) as info:
        replay_study.main(["--quick", "--trace", str(bad), "--results-root", str(tmp_path / "r")])
    assert info.value.code == 2 and f"--trace: {bad}:1:" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_every_naive_unsafe_share_row_is_a_share_of_the_hit_blocks(tmp_path, monkeypatch):
    from experiments import safety_study

    def fake_replay(mix, n_requests, timing_requests, reps, index_kind="art"):
        m = safety_study.MixResult(mix=mix, requests=n_requests, prompt_blocks=100, naive_hit_blocks=40, on_reused=5,
                                   off_reused=6)
        m.naive_unsafe = Counter({safety_study.CATEGORIES[0]: 10})
        m.index_kind = index_kind
        m.timing = [(rep, g, 10.0 + rep) for rep in range(3) for g in ("on", "off")]
        return m

    monkeypatch.setattr(safety_study, "replay", fake_replay)
    with contextlib.redirect_stdout(io.StringIO()):
        safety_study.main(["--quick", "--results-root", str(tmp_path)])
    df = read_summary("safety", tmp_path)
    share = df[df.metric == "naive_unsafe_share"]
    assert len(share) > len(safety_study.CATEGORIES) and set(share["n"]) == {40}
    first = share[share.category == safety_study.CATEGORIES[0]].iloc[0]
    assert first.value == pytest.approx(25.0) and "10 of 40 hit blocks" in first.notes
