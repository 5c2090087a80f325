"""Typed verdicts of the report's sections, second round: each is computed from the results it describes.

- store_dram states the measured cost of crc32c (a range of ratios), never "roughly halves";
- microbench_planner states how much of a plan's time the index lookup takes, per scenario and backend;
- storage names the backend that builds fastest and the one that grows least in memory, per entry count;
- crash says index entries for dropped blocks were seen before reconciliation only when they were;
- store_ssd says in which cells the slab layout beat the file-per-block layout and in which it did not;
- hitrate's two reuse-oracle clauses follow the same tests as its headline;
- a missing (NaN) ratio, median or spread is said to be missing, never sent to a verdict's else-branch.

Each case edits a copy of the committed results (``results/``) under ``tmp_path``, setting every number the
verdict reads, so that no case depends on the timings of the committed run.
"""

from __future__ import annotations

import re

import pytest

from tests.test_report_review_fixes import _TRANSFER_BASE, _row, render, results_copy

NAN = {"value": "nan"}


def _text(tmp_path, study, edits, macro="section"):
    return render(study, results_copy(tmp_path, study, edits), macro)


def _verdict(text: str) -> str:
    return text[text.index("**What does not hold.**"):]


# ---------------------------------------------------------------- 1. typed verdicts that contradicted the results


def _dram(put: dict, crc_put: dict, pg: dict, crc_pg: dict):
    """throughput of put, crc_put, put+get and crc_put+get per block size (GB/s)."""
    edits = []
    for op, per_size in (("put", put), ("crc_put", crc_put), ("put+get", pg), ("crc_put+get", crc_pg)):
        for b, v in per_size.items():
            edits.append((_row("throughput", operation=op, block_bytes=b), {"value": v}))
    return edits


_SIZES = ("65536", "2097152", "33554432")


def test_store_dram_states_the_measured_cost_of_crc32c(tmp_path):
    four = dict.fromkeys(_SIZES, "4.0")
    text = _verdict(_text(tmp_path / "a", "store_dram", _dram(
        four, dict(zip(_SIZES, ("3.0", "2.0", "3.6"))), four, dict.fromkeys(_SIZES, "1.0"))))
    assert ("with crc32c a put runs at 0.5x–0.9x the throughput of a plain put, and a put plus a verified get at "
            "0.25x that of a plain put plus get, depending on block size") in text
    assert "halves" not in text
    missing = _verdict(_text(tmp_path / "b", "store_dram", _dram({}, dict.fromkeys(_SIZES, "nan"), {},
                                                                  dict.fromkeys(_SIZES, "nan"))))
    assert "what crc32c costs was not measured in this run" in missing and "n/a" not in missing


def _locate(ratios: dict):
    return [(_row("plans_per_s", subject="index.locate_arrays only", scenario=sc, backend=b), {"ratio": r})
            for (sc, b), r in ratios.items()]


_CELLS = (("typical", "art"), ("typical", "flat"), ("hot", "art"), ("hot", "flat"))


@pytest.mark.parametrize("ratios, present, absent", [
    (dict.fromkeys(_CELLS, "1.5"), "the index lookup is more than half of a plan's time in every cell, so planner "
     "speed is bounded by the index backend", "less than half"),
    (dict.fromkeys(_CELLS, "3.0"), "the index lookup is less than half of a plan's time in every cell, so the rest "
     "of the planner, not the index backend, bounds its speed", "bounded by the index backend"),
    ({**dict.fromkeys(_CELLS, "1.5"), ("typical", "art"): "3.0"},
     "`locate_arrays` alone runs at 3x (typical mix, art index), 1.5x (typical mix, flat index), 1.5x (hot mix, art "
     "index) and 1.5x (hot mix, flat index) the whole plan's rate: the index lookup is more than half of a plan's "
     "time with the flat index on the typical mix, the art index on the hot mix and the flat index on the hot mix "
     "only", "in every cell"),
    (dict.fromkeys(_CELLS, "nan"), "How much of a plan's time the index lookup takes was not measured in this run",
     "n/a"),
])
def test_microbench_planner_states_the_lookup_share_per_cell(tmp_path, ratios, present, absent):
    text = _verdict(_text(tmp_path, "microbench_planner", _locate(ratios)))
    assert present in text and absent not in text
    assert "most of a plan's time" not in text and "little faster" not in text


def _storage(metric: str, values: dict):
    return [(_row(metric, subject=sub, entries=e), {"value": v}) for (sub, e), v in values.items()]


def _every(value: str, overrides: dict):
    return {**{(sub, e): value for sub in ("art", "rocksdb", "sorted", "flat") for e in ("100000", "1000000")},
            **overrides}


@pytest.mark.parametrize("edits, present, absent", [
    (_storage("rss_growth", _every("1e8", {("sorted", "100000"): "1e6", ("sorted", "1000000"): "1e6"})),
     "the sorted map grows the least in memory at every size", "RocksDB at"),
    (_storage("rss_growth", _every("1e8", {("art", "100000"): "1e6", ("rocksdb", "1000000"): "1e6"})),
     "the ART grows the least in memory at 100,000 entries and RocksDB at 1,000,000 entries", "sorted map"),
    (_storage("insert_rate", _every("1e4", {("art", "100000"): "1e6", ("art", "1000000"): "1e6"})),
     "**What does not hold.** The ART builds fastest at every size;", "flat map builds fastest"),
    (_storage("insert_rate", _every("1e4", {("flat", "100000"): "1e6", ("rocksdb", "1000000"): "1e6"})),
     "**What does not hold.** The flat map builds fastest at 100,000 entries and RocksDB at 1,000,000 entries;",
     "at every size;"),
])
def test_storage_names_the_backend_each_verdict_is_about(tmp_path, edits, present, absent):
    text = _verdict(_text(tmp_path, "storage", edits))
    assert present in text and absent not in text
    assert "uses the least memory at small sizes" not in text


_BEFORE = ("kill_slab", "kill_files", "powerloss_index_slab", "powerloss_index_files")


def test_crash_says_dangling_entries_were_seen_only_when_they_were(tmp_path):
    none = [(_row("dangling_index_entries_before_reconcile", subject=sub), {"value": "0"}) for sub in _BEFORE]
    text = _verdict(_text(tmp_path / "a", "crash", none))
    assert "none was seen before reconciliation in these runs" in text
    assert "can hold entries" not in text and "0 in kill_slab" not in text
    seen = none + [(_row("dangling_index_entries_before_reconcile", subject="kill_slab"), {"value": "3"})]
    text = _verdict(_text(tmp_path / "b", "crash", seen))
    assert ("Right after a crash the index can hold entries for blocks the tier dropped (torn, unacknowledged "
            "writes: 3 in kill_slab, 0 in kill_files") in text
    assert "none was seen" not in text


def _ssd(slab: tuple, files: tuple, **cells):
    """every slab and file-per-block row at (value, p10, p90), with some cells ``<layout>_<op>_<bytes>`` set apart."""
    edits = []
    for layout, default in (("slab", slab), ("files", files)):
        for op in ("put", "put_many"):
            for b in ("65536", "2097152"):
                v, p10, p90 = cells.get(f"{layout}_{op}_{b}", default)
                edits.append((_row("put_throughput", subject=f"tier_{layout}_{op}", block_bytes=b),
                              {"value": v, "p10": p10, "p90": p90}))
    return edits


@pytest.mark.parametrize("edits, present, absent", [
    (_ssd(("200", "190", "210"), ("100", "90", "110")),
     "it beat the file-per-block layout in every cell of this run: `put` of 64 KiB blocks (200 against 100 MB/s)",
     "not with"),
    (_ssd(("200", "190", "210"), ("100", "90", "110"), files_put_many_2097152=("300", "150", "350")),
     "but not with `put_many` of 2 MiB blocks (200 against 300 MB/s, within the spread)", "every cell"),
    (_ssd(("100", "90", "110"), ("300", "290", "310")),
     "it did not beat the file-per-block layout in any cell of this run", "it beat"),
])
def test_store_ssd_says_in_which_cells_the_slab_layout_won(tmp_path, edits, present, absent):
    text = _verdict(_text(tmp_path, "store_ssd", edits))
    assert present in text and absent not in text
    assert "because it beat the file-per-block layout in these runs" not in text


# ---------------------------------------------------------------- 2. hitrate's reuse-oracle clauses


def _oracle(cap: str, value: str):
    return (lambda r: r["metric"] == "information_bound_gap_closed" and r["subject"] == "reuse_oracle"
            and r["trace"] == "conversation_trace" and float(r["flip_rate"]) == 0.0 and r["capacity_blocks"] == cap,
            {"value": value})


def test_hitrate_which_clause_at_the_second_acceptance_size_follows_the_headline(tmp_path):
    worth_all = results_copy(tmp_path / "a", "hitrate", [_oracle("10000", "1.0")])
    assert "from there up the gap is predicting which" in render("hitrate", worth_all, "headline")
    text = _verdict(render("hitrate", worth_all))
    assert "from 10,000 blocks up the gap is what it is worth to know *which* blocks" in text

    partial = results_copy(tmp_path / "b", "hitrate", [_oracle("10000", "0.3"), _oracle("1000", "0.1")])
    assert "from there up" not in render("hitrate", partial, "headline")
    text = _verdict(render("hitrate", partial))
    assert ("The information bounds say why: at 10,000 blocks knowing *which* blocks will be referenced again is "
            "worth 30.0% of the gap (the reuse oracle), not all of it - on this trace") in text
    assert "blocks up the gap is what it is worth" not in text and "there too" not in text


@pytest.mark.parametrize("value, present, absent", [
    ("0.1", "At 1,000 blocks knowing which blocks return is not enough by itself (the reuse oracle, which keeps "
     "them in LRU order, closes 10.0%", "half of the gap or more"),
    ("0.9", "At 1,000 blocks knowing which blocks return is not enough by itself, though it is worth half of the "
     "gap or more (the reuse oracle, which keeps them in LRU order, closes 90.0%", "At 1,000 blocks knowing which "
     "blocks return is not enough by itself (the"),
    ("1.0", "At 1,000 blocks knowing which blocks return is enough by itself (the reuse oracle, which keeps them "
     "in LRU order, closes 100.0%", "not enough by itself"),
])
def test_hitrate_which_clause_at_the_first_acceptance_size_follows_the_oracle(tmp_path, value, present, absent):
    text = _verdict(render("hitrate", results_copy(tmp_path, "hitrate", [_oracle("1000", value)])))
    assert present in text and absent not in text


# ---------------------------------------------------------------- 3. a missing ratio, median or spread


_DEQ = dict(subject="numba int8 dequantize", threads="1")


@pytest.mark.parametrize("study, edits, macro, present, absent", [
    ("microbench_alloc", [(_row("churn_pair_ns"), {"baseline_value": "nan", "ratio": "nan"})], "headline",
     "ns (its plain-Python reference was not timed in this run), taking identical decisions", "the same time"),
    ("kvquant", [(_row("throughput", **_DEQ), {"baseline_value": "nan", "ratio": "nan"})], "section",
     "kernel writes four bytes for each byte it reads (its speed against a copy was not measured in this run).",
     "a copy (n/a)"),
    ("kvquant", [(_row("throughput", bytes_counted="input", **_DEQ), {"ratio": "nan"}),
                 (_row("throughput", bytes_counted="output", **_DEQ), {"ratio": "1.5"})], "section",
     "for each byte it reads, so counted in its output bytes it is faster than a copy (1.5x).", "(n/a)"),
    ("kvquant", [(_row("throughput", subject="numba int8 dequantize", bytes_counted="input", threads="2"), NAN)],
     "section", ("numba int8 dequantize ran at n/a GB/s of input bytes against ",  # (the run's one-thread figure)
                 " GB/s with one thread (not compared: a median is missing)"), "with one thread (slower"),
    ("safety", [(_row("guard_overhead", mix="realistic"), {"p10": "nan", "p90": "nan"}),
                (_row("guard_overhead", mix="adversarial"), {"p10": "-1.0", "p90": "1.0"})], "section",
     "The guard's overhead is not compared with the run-to-run noise on the realistic mix (no p10–p90 spread "
     "recorded); within the run-to-run noise of plan time on the adversarial mix", "timing artefact"),
    ("recovery", [(_row("per_mib_growth", subject="salvage scan, damaged"), NAN)], "section",
     "salvage scan, damaged: how time per MiB changes with size was not measured in this run", "flat: n/a"),
    ("cluster", [(_row("remote_get_p50_s", subject="PooledStore remote get"), {"ratio": "nan"})], "section",
     "(limit 1.5x: not measured)", "does not hold)"),
    ("transfer", [(_row("speedup_over_mooncake"), NAN)], "section",
     "No cell was compared with Mooncake's Transfer Engine in this run.", "Every cell"),
    ("transfer", _TRANSFER_BASE + [(_row("throughput", subject="quillcache tcp", placement="cross_core"),
                                    {"p90": "nan"})], "section",
     "Cross-core, no spread was recorded for these cells (QuillCache's p90", "not even there"),
    ("hitrate", [(_row("reuse_predictability_auc", subject="gradient-boosted trees (online)"), NAN)], "section",
     "cannot be compared with it (an AUC is missing)", "lift that"),
    ("replay", [(_row("block_hit_rate", subject="dynamo/quillhd"), NAN)], "section",
     "**What does not hold.** TTFT comes from the engine model", "changes the hit rate little"),
])
def test_a_missing_number_is_said_to_be_missing(tmp_path, study, edits, macro, present, absent):
    """``present``: a phrase, or a pair of phrases around a figure of the committed run (whatever it is)."""
    text = _text(tmp_path, study, edits, macro)
    if isinstance(present, tuple):
        head, tail = present
        assert re.search(re.escape(head) + r"[\d.,]+" + re.escape(tail), text), (present, text[:3000])
    else:
        assert present in text
    assert absent not in text
