"""``quillcache info``: the package version and whether each compiled core loads.

Exit status 0 when every compiled module imports, 1 otherwise; a module that fails to import is
reported on stdout with its exception, never as a traceback (this is a diagnostic command).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
from pathlib import Path

FAST_MODULES = ("quillcache.alloc._alloc", "quillcache.sketch._sketch", "quillcache.art._art",
                "quillcache.hashing._xxh3")


def _not_built(name: str) -> str | None:
    """Why ``name`` cannot load when no compiled file for it is on disk (found without importing it), else None."""
    import quillcache

    *package, leaf = name.split(".")[1:]
    folder = Path(quillcache.__file__).parent.joinpath(*package)
    if (folder / f"{leaf}.py").exists():
        return None  # a pure-Python module: its own error says it all
    if any((folder / f"{leaf}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return None
    return f"not built: no compiled {leaf} in {folder}; `make install` builds it"


def configure(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    import numpy

    import quillcache

    print(f"quillcache {quillcache.__version__} (numpy {numpy.__version__})")
    ok = True
    for name in FAST_MODULES:
        try:
            importlib.import_module(name)
            print(f"  {name}: ok")
        except Exception as exc:  # report, do not crash
            ok = False
            why = _not_built(name) or f"{type(exc).__name__}: {exc}"
            print(f"  {name}: NOT AVAILABLE ({why})")
    return 0 if ok else 1
