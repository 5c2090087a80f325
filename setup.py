"""Build script for quillcache's compiled cores.

Every ``quillcache/**/_*.pyx`` becomes the extension module of its dotted path, beside its Python
API (scikit-learn style): ``quillcache/alloc/_alloc.pyx`` -> ``quillcache.alloc._alloc``. C headers
live in ``include/`` folders next to the ``.pyx`` that uses them.
Cython directives are set once here for the whole build (scikit-learn style):
bounds checking, negative indexing and initialisation checks are off, C division is on.
``QUILLCACHE_CYTHON_DEBUG=1`` turns the safety checks back on (and builds with ``-O0 -g``)
for debugging a crash. ``QUILLCACHE_ONLY=_alloc,_sketch`` restricts the build to the
named modules (a development convenience).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
DEBUG = os.environ.get("QUILLCACHE_CYTHON_DEBUG", "0") not in ("", "0", "false", "no")
ONLY = {n.strip() for n in os.environ.get("QUILLCACHE_ONLY", "").split(",") if n.strip()}

DIRECTIVES = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "nonecheck": DEBUG,
    "cdivision": not DEBUG,
    "embedsignature": True,
}

COMPILE_ARGS = ["-O0", "-g"] if DEBUG else ["-O3"]


def _extensions() -> list[Extension]:
    exts = []
    for pyx in sorted((HERE / "quillcache").glob("**/_*.pyx")):
        if ONLY and pyx.stem not in ONLY:
            continue
        rel = pyx.relative_to(HERE)
        include = [np.get_include(), str(rel.parent)]
        if (pyx.parent / "include").is_dir():
            include.append(str(rel.parent / "include"))
        exts.append(
            Extension(
                ".".join(rel.with_suffix("").parts),
                [str(rel)],
                include_dirs=include,
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=COMPILE_ARGS,
            )
        )
    return exts


setup(
    ext_modules=cythonize(
        _extensions(),
        compiler_directives=DIRECTIVES,
        annotate=False,
        force=DEBUG,
    ),
)
