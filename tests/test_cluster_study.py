"""Smoke test of the cluster study: its quick profile runs end to end on real processes (a master and three
node processes, trials with a SIGKILLed node, latency against the raw-socket baseline, throughput with 3/2/1
nodes, pooled vs per-node hit rate when the trace is present), loses nothing, serves no corrupt byte, and the
report section and the figure render from what it wrote. Nothing here asserts speed."""

from __future__ import annotations

import math

from quillcache.results import read_anchors
from quillcache.results import read_summary as read_tidy
from results_copy import copy_study


def test_quick_profile_runs_and_loses_nothing(quick_run, read_summary):
    run = quick_run("experiments.cluster_study")
    read_summary(run.root / "cluster" / "summary.csv", run.rows)
    df = read_tidy("cluster", run.root)
    sub = "PooledStore on 3 node processes"
    v = lambda metric, subject=sub: float(df[(df.metric == metric) & (df.subject == subject)]["value"].iloc[0])  # noqa: E731
    assert v("trials") >= 2 and v("gets") > 0 and v("gets_bit_exact") == v("gets") - v("gets_missed")
    assert v("corrupt_bytes_served") == 0 and v("lost_with_replica") == 0 and v("stale_index_entries") == 0
    assert v("expired_trials") == v("trials")  # the master expired every killed node
    lat = df[df.metric == "get_latency_s"]
    assert set(lat["where"]) == {"remote", "local"} and (lat["value"] > 0).all()
    acc = df[df.metric == "remote_get_p50_s"].iloc[0]
    assert acc["baseline"] and acc["baseline_value"] > 0 and math.isfinite(acc["ratio"])
    tp = df[df.metric == "throughput_gb_per_s"]
    assert set(tp["nodes"].astype(int)) == {1, 2, 3} and (tp["value"] > 0).all()
    if float(df[df.metric == "hitrate_available"]["value"].iloc[0]):
        hr = df[df.metric == "block_hit_rate"]
        assert len(hr) == 2 and (hr["value"] >= 0).all()
        assert float(df[df.metric == "hit_blocks_corrupt"]["value"].sum()) == 0
    assert len(read_anchors("cluster", run.root)) == 1  # the paper's ratio: an anchor, never a baseline

    from experiments import cluster_study, report

    assert cluster_study.plot(str(run.root), run.root / "figures").stat().st_size > 0
    view = report.StudyView("cluster", str(run.root))
    env = report._environment()
    text = env.from_string('{% import "sections/cluster.md.j2" as t %}{{ t.section(s) }}{{ t.headline(s) }}').render(s=view)
    assert "What does not hold" in text and "corrupt bytes served" in text and "n/a" not in text.split("**Get")[1][:400]


def test_lru_reference_matches_the_hit_rule_on_a_small_trace():
    from experiments.cluster_study import lru_reference
    from quillcache.traces.loader import TraceRequest

    reqs = [TraceRequest(i, 3 * 16, 1, ids, block_tokens=16) for i, ids in enumerate([(1, 2, 3), (1, 2, 4), (1, 5, 6),
                                                                                       (1, 2, 3)])]
    # one cache of 3 blocks: hits 0, 2 (1,2), 1 (1), then 1 (block 2 was evicted by 5, so the prefix stops there)
    assert lru_reference(reqs, 1, 3) == (0 + 2 + 1 + 1) / 12
    assert lru_reference(reqs, 1, 100) == (0 + 2 + 1 + 3) / 12
    # round robin over two engines: requests 0, 2 on one cache (hits 0, 1), 1, 3 on the other (hits 0, 2)
    assert lru_reference(reqs, 2, 100) == (0 + 1 + 0 + 2) / 12


def test_figure_and_report_render_when_the_trace_was_absent(tmp_path):
    """Without the conversation trace the study writes ``hitrate_available = 0`` and no hit-rate rows (so no
    ``capacity_blocks_per_node`` column): the figure says so in the hit-rate panel, the report renders."""
    from pathlib import Path

    import pandas as pd

    from experiments import cluster_study, report

    src = Path(__file__).resolve().parents[1] / "results" / "cluster"
    dst = tmp_path / "cluster"
    copy_study(src, dst)
    df = pd.read_csv(dst / "summary.csv", keep_default_na=False, dtype=str)
    hit = df["metric"].isin(["block_hit_rate", "lru_model_hit_rate", "hit_blocks_corrupt"])
    assert hit.any()  # (the committed results were measured with the trace)
    df = df[~hit]
    df.loc[df["metric"] == "hitrate_available", ["value", "notes"]] = ["0.0", "not measured: the trace is absent"]
    df.drop(columns=["capacity_blocks_per_node"]).to_csv(dst / "summary.csv", index=False)
    assert cluster_study.plot(str(tmp_path), tmp_path / "figures").stat().st_size > 0
    view = report.StudyView("cluster", str(tmp_path))
    report._environment().from_string('{% import "sections/cluster.md.j2" as t %}{{ t.section(s) }}').render(s=view)
