"""The top-level package: what ``import quillcache`` exposes, and that importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import quillcache

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(quillcache.__all__))
def test_every_exported_name_resolves(name):
    assert getattr(quillcache, name) is not None


def test_unknown_attribute_names_itself():
    with pytest.raises(AttributeError, match="no_such_thing"):
        quillcache.no_such_thing  # noqa: B018


def test_lazy_names_are_the_subpackage_objects():
    from quillcache.policies import make_policy
    from quillcache.store.ssd import SsdTier

    assert quillcache.make_policy is make_policy
    assert quillcache.SsdTier is SsdTier


def test_import_loads_no_compiled_core_or_heavy_dependency():
    code = ("import sys, quillcache\n"
            "heavy = [m for m in ('quillcache.art._art', 'quillcache.alloc._alloc', 'quillcache.sketch._sketch',"
            " 'numba', 'pandas', 'rocksdict') if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_no_loose_modules_at_the_package_root():
    """Concepts live in subpackages; the root holds only the shared leaf modules."""
    root = ROOT / "quillcache"
    loose = sorted(p.name for p in root.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "_checks.py", "_jitcache.py", "_mix.py", "_ratelog.py",
                     "registry.py", "types.py"], loose


MAX_SOURCE_LINES = 600
LONG_FILE_REASON = "Longer than 600 lines because"


def _sources():
    root = ROOT / "quillcache"
    for pattern in ("*.py", "*.pyx", "*.pxd", "*.pxi", "*.h"):
        yield from root.rglob(pattern)


def test_no_source_file_is_over_600_lines_without_saying_why():
    """One concept per module: a longer file must state in its own docstring why it cannot be split."""
    too_long = []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") > MAX_SOURCE_LINES and LONG_FILE_REASON not in text[:4000]:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not too_long, too_long
