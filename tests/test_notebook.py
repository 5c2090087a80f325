"""The analysis notebook runs end to end against the committed results (nbclient), and the
committed notebook holds the cells its generator writes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"


def test_committed_notebook_has_the_generated_cells():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_notebook", ROOT / "notebooks" / "make_notebook.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert [c.source for c in committed.cells] == [c.source for c in mod.build().cells]


@pytest.mark.timeout(180)
def test_notebook_executes_against_results_in_under_a_minute(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    kernel_tmp = tmp_path / "tmp"  # the kernel's temporary folders: nothing may be left there
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))

    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    (tmp_path / "results").symlink_to(ROOT / "results")
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    shutil.copy(NOTEBOOK, nb_dir / "analysis.ipynb")
    nb = nbformat.read(nb_dir / "analysis.ipynb", as_version=4)
    t0 = time.monotonic()
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(nb_dir)}}).execute()
    elapsed = time.monotonic() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) >= 12  # every study's figure (hit rate draws two)
    assert elapsed < 60, f"the notebook took {elapsed:.0f} s"
    assert [p.name for p in kernel_tmp.iterdir()] == []  # the redrawn figures' folder went with the kernel
