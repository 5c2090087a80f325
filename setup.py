"""Build script for quillcache's compiled cores.

Every ``quillcache/_fast/*.pyx`` becomes an extension module ``quillcache._fast.<name>``.
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
    for pyx in sorted((HERE / "quillcache" / "_fast").glob("*.pyx")):
        if ONLY and pyx.stem not in ONLY:
            continue
        exts.append(
            Extension(
                f"quillcache._fast.{pyx.stem}",
                [str(pyx.relative_to(HERE))],
                include_dirs=[np.get_include()],
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
