"""``copy_study``: a study's committed results copied for a test to edit.

A run's ``meta.json`` records a digest of its ``summary.csv`` and ``anchors.csv``, and the reader refuses a
summary that does not match (one run's numbers never pass for another's). A test that edits a copied summary
makes a new, unsealed run: the copy's metadata keeps everything but the digests, which it drops, as results
written before digests were recorded have none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DIGEST_FIELDS = ("summary_sha256", "anchors_sha256")


def copy_study(src: Path, dst: Path) -> Path:
    """Copy the study folder ``src`` to ``dst`` (created with its parents) without its digests; returns ``dst``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock", ".*.tmp"))
    meta = dst / "meta.json"
    if meta.exists():
        m = json.loads(meta.read_text(encoding="utf-8"))
        for k in DIGEST_FIELDS:
            m.pop(k, None)
        meta.write_text(json.dumps(m, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return dst
