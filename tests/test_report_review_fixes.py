"""Review fixes of the report, its templates, the figure step, the notebook and the custom runs of the
replay and safety studies.

- a verdict in the report or README block (a target reached or not, an overhead within the noise or
  not, the core count, faster or slower, ...) is computed from the results, so it follows them;
- every registered study is accounted for: one without results is named, with its make target;
- the report embeds the figures the drawing step recorded, never a file an earlier run left behind;
- every notebook cell runs against a root missing a study or a study's ``meta.json``;
- a replay on another trace and a safety run on another index backend are marked ``custom``, name
  their trace / backend, and the report and README say so.

Each case edits a copy of the committed results (``results/``) under ``tmp_path``.
"""

from __future__ import annotations

import ast
import csv
import json
import sys
import textwrap
import types
from pathlib import Path

import pytest

from experiments import figures, report
from experiments.studies import STUDIES, Study
from quillcache.results import SummaryRow, read_meta, read_summary, write_summary
from results_copy import copy_study

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def results_copy(tmp_path: Path, study: str, edits=(), meta: dict | None = None) -> Path:
    """``results/<study>`` copied under ``tmp_path/results`` with ``edits`` applied to its summary:
    ``(predicate(row) -> bool, {column: new text})``, each matching at least one row."""
    root = tmp_path / "results"
    copy_study(RESULTS / study, root / study)
    path = root / study / "summary.csv"
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        fields, rows = reader.fieldnames, list(reader)
    for pred, update in edits:
        hit = [r for r in rows if pred(r)]
        assert hit, f"no {study} row matches the edit {update}"
        for r in hit:
            r.update(update)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    if meta:
        m = json.loads((root / study / "meta.json").read_text())
        m.update(meta)
        (root / study / "meta.json").write_text(json.dumps(m))
    return root


def render(study: str, root: Path, macro: str = "section") -> str:
    """One study's section (or headline) rendered from ``root``, on one line per paragraph."""
    text = report._environment().from_string(
        '{% import "sections/' + study + '.md.j2" as t %}{{ t.' + macro + "(s) }}").render(
        s=report.StudyView(study, str(root)))
    return " ".join(text.split())


# ---------------------------------------------------------------- 1. verdicts computed from the results


def _conv(metric: str, subject: str | None = None, cap: str | None = None):
    return lambda r: (r["metric"] == metric and r["trace"] == "conversation_trace"
                      and (subject is None or r["subject"] == subject) and (cap is None or r["capacity_blocks"] == cap))


def test_the_hitrate_target_and_its_what_does_not_hold_follow_the_results(tmp_path):
    reached = results_copy(tmp_path / "b", "hitrate", [
        (_conv("gap_closed", "quillchain"), {"value": "0.6"}),
        *[(_conv("hit_rate", p, "100000"), {"value": "0.366"}) for p in ("fifo", "2q", "lengthaware", "tinylfu")]])
    head = render("hitrate", reached, "headline")
    assert "the target was 50%: reached" in head and "not reached" not in head
    text = render("hitrate", reached)
    assert "No online policy" not in text
    assert "Half of the LRU-to-Belady gap on the conversation trace is closed at 1,000 blocks by quillchain" in text
    assert "every policy is within one point of the unlimited hit rate" in text

    partly = results_copy(tmp_path / "c", "hitrate", [(_conv("gap_closed", "quillchain", "1000"), {"value": "0.6"})])
    assert "the target was 50%: reached at 1,000 blocks only" in render("hitrate", partly, "headline")

    committed = results_copy(tmp_path / "a", "hitrate")
    assert "the target was 50%: not reached" in render("hitrate", committed, "headline")
    text = render("hitrate", committed)
    assert "No online policy here closes half of the LRU-to-Belady gap at 1,000 or 10,000 blocks" in text
    assert "wrong about fewer than 20% of requests" in text  # the reuse oracle's table: 28.1% closed at 20%
    assert "every policy but fifo (0.356), 2q (0.356), lengthaware (0.334) and tinylfu (0.291)" in text


def test_the_safety_overhead_verdict_follows_its_spread(tmp_path):
    costly = results_copy(tmp_path / "b", "safety", [
        (lambda r: r["metric"] == "guard_overhead" and r["mix"] == "realistic",
         {"value": "25.0", "p10": "20.0", "p90": "30.0"})])
    text = render("safety", costly)
    assert "above the run-to-run noise on the realistic mix" in text
    assert "within the run-to-run noise of plan time on the adversarial mix" in text
    assert "realistic and adversarial" not in text
    straddling = results_copy(tmp_path / "a", "safety", [  # p10-p90 straddles zero on both mixes
        (lambda r: r["metric"] == "guard_overhead" and r["mix"] in ("realistic", "adversarial"),
         {"value": "0.5", "p10": "-2.0", "p90": "3.0"})])
    text = render("safety", straddling)
    assert "within the run-to-run noise of plan time on the realistic and adversarial mixes" in text


def test_the_readme_block_states_the_core_count_of_the_runs(tmp_path):
    root = results_copy(tmp_path, "microbench_alloc", meta={"cpu_count": 64})
    block = report.render_readme_block(str(root))
    assert "this project's 64-core machine" in block and "2-core" not in block


def _row(metric: str, **params):
    return lambda r: r["metric"] == metric and all(r[k] == v for k, v in params.items())


_CELL_A = dict(placement="cross_core", op="read", block_bytes="2097152", batch="16")
_CELL_B = dict(placement="cross_core", op="write", block_bytes="2097152", batch="16")
_TRANSFER_BASE = [(_row("speedup_over_mooncake", **_CELL_A), {"value": "1.5"}),
                  (_row("speedup_over_mooncake", **_CELL_B), {"value": "1.5"}),
                  (_row("throughput", subject="quillcache tcp", **_CELL_A), {"p90": "1000.0"}),
                  (_row("throughput", subject="quillcache tcp", **_CELL_B), {"p90": "0.0"})]
# Each case names its base: edits that make the base render the verdict the case takes away, so that no
# case depends on the timings of the committed run (a re-run may move them).
_MASTER_SLOW_RPC = [(_row("ops_per_s", subject="quillcache rpc", op="exists", batch="1"), {"value": "5000.0"})]
_ALLOC_BASE = [(_row("churn_pair_ns"), {"value": "150.0", "baseline_value": "300.0", "ratio": "0.5"})]
_KVQUANT_BASE = [(_row("throughput", subject="numba int8 dequantize", bytes_counted="input", threads="1"),
                  {"ratio": "0.3"})]
_REPLAY_BASE = [(_row("ttft_p99_s", subject="prefix_affinity/lru", tiers="default"), {"value": "1000.0"}),
                (_row("ttft_p99_s", subject="round_robin/lru", tiers="default"), {"value": "2.0"}),
                (_row("block_hit_rate", subject="dynamo/quillhd", tiers="small"), {"value": "0.1"}),
                (_row("block_hit_rate", subject="dynamo/lru", tiers="small"), {"value": "0.1"})]
_TE_BELOW_STORE = [(_row("throughput", subject="Mooncake TE tcp", placement="cross_core", op="read", batch="1",
                         block_bytes="65536"), {"value": "0.0001"})]


@pytest.mark.parametrize("study, base, edits, meta, macro, present, absent", [
    # the Cython allocator slower than its reference: not "faster"
    ("microbench_alloc", _ALLOC_BASE,
     [(_row("churn_pair_ns"), {"value": "250.0", "baseline_value": "200.0", "ratio": "1.25"})], None,
     "headline", "(1.25x slower)", "faster"),
    # BLAKE2b faster than every XXH3 form: no "slower than XXH3"
    ("microbench_hashing", [], [(_row("blocks_per_s", subject="blake2b_keyed_chain"), {"value": "1e9"})],
     None, "section", "is a cryptographic hash; it is used only", "slower than XXH3"),
    # the dequantize kernel above half a copy in input bytes and slower than one in output bytes
    ("kvquant", _KVQUANT_BASE,
     [(_row("throughput", subject="numba int8 dequantize", bytes_counted="input", threads="1"), {"ratio": "0.7"}),
      (_row("throughput", subject="numba int8 dequantize", bytes_counted="output", threads="1"), {"ratio": "0.9"})],
     None, "section", "it stays below a copy (0.7x); counted in its output bytes it is slower than one (0.9x)",
     "below half a copy"),
    # the core count of the master's run (the committed run had 2 cores), never a typed "two-core"
    # (base and edit: single-key round trips under the 10,000/s, the sentence that names the machine)
    ("master", _MASTER_SLOW_RPC, _MASTER_SLOW_RPC, {"cpu_count": 16}, "section", "on this shared 16-core machine",
     "on this shared 2-core machine"),
    # Mooncake's Transfer Engine faster than the Store's anchors in every cell: not "only some"
    ("transfer", _TE_BELOW_STORE,
     [(_row("throughput", subject="Mooncake TE tcp", placement="cross_core", op="read", batch="1"), {"value": "5.0"})],
     None, "section", "is faster than the Store in every one of the single-block reads", "only some"),
    # QuillCache's p90 far above every cross-core cell's floor (the base: two cells below 2x Mooncake,
    # one of them within its spread, one not: _TRANSFER_BASE)
    ("transfer", _TRANSFER_BASE,
     _TRANSFER_BASE + [(_row("throughput", subject="quillcache tcp", placement="cross_core"), {"p90": "1000.0"})],
     None, "section", "every one of these cells reaches the floor within this run's spread", "not even there"),
    # the eviction policy moves the small-tier hit rate by 5 points; prefix affinity no slower than round-robin
    ("replay", _REPLAY_BASE, [(_row("block_hit_rate", subject="dynamo/quillhd", tiers="small"), {"value": "0.25"}),
                (_row("ttft_p99_s", subject="prefix_affinity/lru", tiers="default"), {"value": "1.0"})],
     None, "section", "changes the block hit rate by a point or more with the small tiers (QuillHD 0.2500",
     "overloads"),
])
def test_typed_verdicts_of_other_sections_follow_the_results(tmp_path, study, base, edits, meta, macro, present,
                                                             absent):
    base_text = render(study, results_copy(tmp_path / "a", study, base), macro)
    assert absent in base_text  # the base results render the verdict the edit takes away
    text = render(study, results_copy(tmp_path / "b", study, edits, meta), macro)
    assert present in text and absent not in text


# ---------------------------------------------------------------- 2. a registered study without results


def test_every_registered_study_without_results_is_named_with_its_make_target(tmp_path):
    root = results_copy(tmp_path, "microbench_alloc")
    text = report.render_report(str(root), tmp_path / "figures", generated_at="T")
    block = report.render_readme_block(str(root))
    missing = [STUDIES[n] for n in STUDIES.names() if n != "microbench_alloc"]
    assert missing
    for s in missing:
        assert f"| {s.title} | no results |" in text
        assert f"{s.title} (`{s.name}`: `make {s.make_target}`)" in text
        assert (f"**{s.title}** (`make {s.make_target}`): no results in this root (no `{s.name}/summary.csv`); "
                f"`make {s.make_target}` produces them.") in block
    assert "## Offset allocator" in text  # the study with results keeps its section
    assert report.missing_studies(str(RESULTS)) == []  # every registered study has committed results


# ---------------------------------------------------------------- 3. the figures the drawing step drew


@pytest.fixture
def figure_study(tmp_path, monkeypatch):
    """A registered study whose plot() draws ``<name>.png`` always and ``<name>_extra.png`` only when
    its results have a row with metric 'extra'."""
    mod = tmp_path / "mods" / "unit_figure_study.py"
    mod.parent.mkdir()
    mod.write_text(textwrap.dedent('''
        from pathlib import Path
        from quillcache.results import read_summary

        def plot(results_root=None, out_dir="paper/figures"):
            out = [Path(out_dir) / "unit_fig.png"]
            if "extra" in set(read_summary("unit_fig", results_root)["metric"]):
                out.append(Path(out_dir) / "unit_fig_extra.png")
            for p in out:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(b"png")
            return out
    '''))
    monkeypatch.syspath_prepend(str(mod.parent))
    monkeypatch.setitem(STUDIES, "unit_fig", Study(name="unit_fig", module="unit_figure_study", title="Unit figure",
                                                   make_target="none"))
    return "unit_fig"


def _write(root: Path, metrics: list[str]) -> None:
    write_summary("unit_fig", [SummaryRow(metric=m, subject="a", value=1.0, unit="u") for m in metrics], root=root,
                  profile="quick")


def _figures_of(root: Path, figs: Path) -> list[str]:
    return [v.figures for v in report.views(str(root), figs) if v.name == "unit_fig"][0]


def test_the_report_embeds_only_the_figures_this_drawing_drew(tmp_path, figure_study):
    root, figs = tmp_path / "results", tmp_path / "figures"
    _write(root, ["m", "extra"])
    assert {k: [p.name for p in v] for k, v in figures.draw_all(str(root), figs).items()} == \
        {"unit_fig": ["unit_fig.png", "unit_fig_extra.png"]}
    assert _figures_of(root, figs) == ["unit_fig.png", "unit_fig_extra.png"]
    _write(root, ["m"])  # this run has no 'extra' rows: its plot() no longer draws the second figure
    figures.draw_all(str(root), figs)
    assert (figs / "unit_fig_extra.png").is_file()  # left over from the earlier drawing
    assert _figures_of(root, figs) == ["unit_fig.png"]
    assert json.loads((figs / figures.MANIFEST).read_text()) == {"unit_fig": ["unit_fig.png"]}
    (figs / "unit_fig.png").unlink()  # a recorded figure that is gone is not embedded either
    assert _figures_of(root, figs) == []


def test_a_damaged_figures_manifest_is_an_error_naming_it(tmp_path, figure_study):
    root, figs = tmp_path / "results", tmp_path / "figures"
    _write(root, ["m"])
    figs.mkdir()
    (figs / figures.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=r"drawn\.json: not valid JSON.*make figures"):
        report.views(str(root), figs)
    (figs / figures.MANIFEST).write_text('{"unit_fig": "unit_fig.png"}')
    with pytest.raises(ValueError, match="expected"):
        report.views(str(root), figs)


# ---------------------------------------------------------------- 4. the notebook against a partial root


def test_every_notebook_cell_runs_without_a_study_or_its_meta(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_notebook_t", ROOT / "notebooks" / "make_notebook.py")
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    copy_study(RESULTS / "safety", tmp_path / "results" / "safety")
    (tmp_path / "results" / "safety" / "meta.json").unlink()  # results from before metadata was recorded
    cells = [c.source for c in mk.build().cells if c.cell_type == "code"]
    setup = cells[0].replace('ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()',
                             f"ROOT = Path({str(tmp_path)!r})").replace("sys.path.insert(0, str(ROOT))", "")
    assert setup != cells[0]
    ns: dict = {}
    *body, last = ast.parse(setup).body  # the cell's last expression is the table it shows
    exec(compile(ast.Module(body=body, type_ignores=[]), "setup", "exec"), ns)
    table = eval(compile(ast.Expression(last.value), "setup", "eval"), ns)
    assert list(table.index) == ["safety"] and table.loc["safety", "profile"] == "(no meta.json)"
    for code in cells[1:]:
        if "show_figure" not in code or "safety" not in code:  # safety's figure: drawn by test_notebook
            exec(code, ns)
    out = capsys.readouterr().out
    for name in STUDIES.names():
        if name != "safety":
            assert f"{name}: no results under" in out and f"`make {STUDIES[name].make_target}` produces them" in out


# ---------------------------------------------------------------- 5. custom runs


def _stub_replay(monkeypatch, replay_study):
    def fake_replay(reqs, cfg):
        d = {"router": cfg.router, "policy": cfg.policy, "engines": 4, "dram_capacity_blocks": cfg.dram_capacity_blocks,
             "ssd_capacity_blocks": cfg.ssd_capacity_blocks, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2,
             "goodput_rps": 1.0, "slo_attainment": 1.0, "block_hit_rate": 0.5, "token_hit_rate": 0.5,
             **{f"block_hit_rate_{t}": 0.125 for t in ("gpu", "dram", "ssd", "peer")}}
        return types.SimpleNamespace(summary=types.SimpleNamespace(as_dict=lambda: d))

    seen = []
    monkeypatch.setattr(replay_study, "load_trace", lambda path, limit=None: seen.append(Path(path)) or [object()] * 10)
    monkeypatch.setattr(replay_study, "replay", fake_replay)
    monkeypatch.delenv("QUILLCACHE_TRACE", raising=False)
    return seen


def test_a_replay_on_another_trace_is_a_custom_run_and_says_so(tmp_path, monkeypatch):
    from experiments import replay_study
    from quillcache.traces.loader import DEFAULT_TRACE

    seen = _stub_replay(monkeypatch, replay_study)
    copy = tmp_path / "copy" / DEFAULT_TRACE.name  # $QUILLCACHE_TRACE: the user's copy of the shared trace
    replay_study.run(results_root=str(tmp_path / "default"))
    replay_study.run(results_root=str(tmp_path / "named"), trace=str(DEFAULT_TRACE))
    monkeypatch.setenv("QUILLCACHE_TRACE", str(copy))
    replay_study.run(results_root=str(tmp_path / "copy_env"))
    replay_study.run(results_root=str(tmp_path / "copy_named"), trace=str(copy))
    assert seen == [DEFAULT_TRACE, DEFAULT_TRACE, copy, copy]
    for root in ("default", "named", "copy_env", "copy_named"):
        assert read_meta("replay", tmp_path / root).profile == "full"
        assert set(read_summary("replay", tmp_path / root)["trace"]) == {"conversation_trace"}
    replay_study.run(results_root=str(tmp_path / "env_other"), trace=str(DEFAULT_TRACE))  # not the env's copy
    assert read_meta("replay", tmp_path / "env_other").profile == "custom"
    monkeypatch.delenv("QUILLCACHE_TRACE")
    other = tmp_path / "my_other_trace.jsonl"
    root = tmp_path / "custom"
    monkeypatch.chdir(tmp_path)
    replay_study.main(["--results-root", str(root), "--trace", str(other)])
    assert read_meta("replay", root).profile == "custom"
    df = read_summary("replay", root)
    assert set(df["trace"]) == {"my_other_trace"} and df["notes"].str.contains("custom trace my_other_trace.jsonl").all()
    block = report.render_readme_block(str(root))
    assert "(`make replay`, custom profile): replaying 10 requests of the trace `my_other_trace` (a custom run" in block
    text = report.render_report(str(root), tmp_path / "figures", generated_at="T")
    assert "*A custom run* (profile `custom`)" in text and "requests of the trace `my_other_trace`" in text


def test_a_safety_run_on_another_index_backend_is_a_custom_run_and_says_so(tmp_path, monkeypatch):
    from experiments import safety_study

    def fake_replay(mix, n_requests, timing_requests, reps, index_kind="art"):
        m = safety_study.MixResult(mix=mix, requests=n_requests, prompt_blocks=100, naive_hit_blocks=10, on_reused=5,
                                   off_reused=6)
        m.index_kind = index_kind
        m.timing = [(rep, g, 10.0 + rep) for rep in range(3) for g in ("on", "off")]
        return m

    monkeypatch.setattr(safety_study, "replay", fake_replay)
    safety_study.main(["--quick", "--results-root", str(tmp_path / "art")])
    assert read_meta("safety", tmp_path / "art").profile == "quick"
    assert set(read_summary("safety", tmp_path / "art")["index_kind"]) == {"art"}
    root = tmp_path / "custom"
    safety_study.main(["--quick", "--results-root", str(root), "--index", "sorted"])
    assert read_meta("safety", root).profile == "custom"
    assert set(read_summary("safety", root)["index_kind"]) == {"sorted"}
    block = report.render_readme_block(str(root))
    assert "(`make safety`, custom profile)" in block
    assert "(a custom run on the `sorted` residency index backend, not the default ART)" in block
    text = report.render_report(str(root), tmp_path / "figures", generated_at="T")
    assert "*A custom run* (profile `custom`)" in text
    assert "real residency index (a custom run on the `sorted` residency index backend" in text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_sizes_render_in_binary_units():
    from experiments.report import fmt_bytes

    assert [fmt_bytes(v) for v in (65536, 2 << 20, 32 << 20, 1000, 1536, float("nan"))] == \
        ["64 KiB", "2 MiB", "32 MiB", "1,000 B", "1.5 KiB", "n/a"]
