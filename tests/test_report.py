"""The report generator reads only results/ and the figures beside it."""

from __future__ import annotations

from experiments.report import render
from quillcache.results import SummaryRow, write_summary


def test_report_lists_every_study_its_rows_and_its_figure_panels(tmp_path):
    root, figs = tmp_path / "results", tmp_path / "paper" / "figures"
    for study in ("store", "store_dram"):
        write_summary(study, [SummaryRow(metric="m", subject=f"{study}-subject", value=2.0, unit="x",
                                         baseline="b", baseline_value=1.0)], root=str(root))
    figs.mkdir(parents=True)
    for stem in ("store", "store_extra", "store_dram"):
        (figs / f"{stem}.png").write_bytes(b"png")
    text = render(root, figs)
    assert "## store\n" in text and "## store_dram\n" in text
    assert "store-subject" in text and "store_dram-subject" in text
    store_part = text.split("## store\n")[1].split("## store_dram\n")[0]
    # a study's own panels, but not another study's figure that shares its prefix
    assert "figures/store.png" in store_part and "figures/store_extra.png" in store_part
    assert "figures/store_dram.png" not in store_part
