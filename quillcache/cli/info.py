"""``quillcache info``: the package version and whether each compiled core loads.

Exit status 0 when every compiled module imports, 1 otherwise; a module that fails to import is
reported on stdout with its exception, never as a traceback (this is a diagnostic command).
"""

from __future__ import annotations

import argparse
import importlib

FAST_MODULES = ("quillcache.alloc._alloc", "quillcache.sketch._sketch", "quillcache.art._art",
                "quillcache.hashing._xxh3")


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
            print(f"  {name}: NOT AVAILABLE ({type(exc).__name__}: {exc})")
    return 0 if ok else 1
