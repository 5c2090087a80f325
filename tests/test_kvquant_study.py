"""Smoke test of the kvquant study: the quick profile runs into a temporary results root, reproduces
REFERENCE §12's relMSE table within 1.5x, and the report section and figure render from what it wrote."""

from __future__ import annotations

from experiments import kvquant_study
from quillcache.results import read_anchors, read_summary


def test_quick_profile_reproduces_the_reference_table_and_renders(tmp_path, monkeypatch):
    monkeypatch.setattr(kvquant_study, "QUICK", dict(kvquant_study.QUICK, reps=2, calls=1))
    rows = kvquant_study.run(quick=True, results_root=str(tmp_path))
    df = read_summary("kvquant", tmp_path)
    assert len(df) == len(rows)
    ratios = df[df.metric == "relmse_vs_reference"]["value"]
    assert len(ratios) == 12 and ((ratios > 1 / 1.5) & (ratios < 1.5)).all(), ratios.tolist()
    assert len(read_anchors("kvquant", tmp_path)) == 12
    thr = df[df.metric == "throughput"]
    assert {"numba int8 quantize", "numba int8 dequantize"} <= set(thr.subject) and (thr.value > 0).all()
    assert df[df.metric == "gpu_measured"]["notes"].iloc[0].startswith("not measured")
    attn = df[df.metric == "attention_relmse"].set_index("subject")["value"]
    assert attn["int8 per token-head"] < attn["int4 KIVI (K per-channel, V per-token)"] < \
        attn["int2 KIVI (K per-channel, V per-token)"]

    from experiments import report

    view = report.StudyView("kvquant", str(tmp_path))
    text = report._environment().from_string(
        '{% import "sections/kvquant.md.j2" as t %}{{ t.section(s) }}{{ t.headline(s) }}').render(s=view)
    assert "What does not hold" in text and "REFERENCE" in text
    assert kvquant_study.plot(str(tmp_path), tmp_path / "figures").stat().st_size > 0
