"""``quillcache info``: the package version and whether each compiled core loads.

Exit status 0 when every compiled module imports, 1 otherwise; a module that fails to import is
reported on stdout with its exception, never as a traceback (this is a diagnostic command).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
from pathlib import Path

NUMBA_MODULES = ("quillcache.hashing._xxh3",)  # compiled at first use, not at install


def fast_modules() -> list[str]:
    """Every compiled core: the extension module of each ``quillcache/**/_*.pyx`` (setup.py builds each one),
    of each compiled ``_*`` file found without its source, and the Numba modules. Found on disk, so a new
    core is checked without being listed here."""
    import quillcache

    root = Path(quillcache.__file__).parent
    names = {".".join(("quillcache", *p.relative_to(root).with_suffix("").parts)) for p in root.glob("**/_*.pyx")}
    suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=len, reverse=True)  # ".cpython-...so" before ".so"
    for p in root.glob("**/_*.*"):
        suffix = next((x for x in suffixes if p.name.endswith(x)), None)
        if suffix is not None:
            names.add(".".join(("quillcache", *p.relative_to(root).parent.parts, p.name[: -len(suffix)])))
    return sorted(names) + list(NUMBA_MODULES)


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
    for name in fast_modules():
        try:  # only the import: an error printing (a closed pipe) is not the module's
            importlib.import_module(name)
        except Exception as exc:  # report, do not crash
            ok = False
            why = _not_built(name) or f"{type(exc).__name__}: {exc}"
            print(f"  {name}: NOT AVAILABLE ({why})")
        else:
            print(f"  {name}: ok")
    return 0 if ok else 1
