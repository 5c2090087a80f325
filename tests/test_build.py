"""The build: every Cython module translates under the debug directives (bounds, wraparound,
initialization and None checks on: the README's debug build), and ``make clean`` forgets the
install stamp so the next ``make test`` rebuilds what it deleted.

Translating (Cython to C) is what failed before (``Operation not allowed without gil``); the C
compile of the same sources is what every ``make install`` does, so it is not repeated here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYX = sorted((ROOT / "quillcache").glob("**/_*.pyx"))

_TRANSLATE = """
import sys
from Cython.Build import cythonize
src, out = sys.argv[1], sys.argv[2]
debug = dict(language_level="3", boundscheck=True, wraparound=True, initializedcheck=True, nonecheck=True,
             cdivision=False, embedsignature=True)
cythonize([src], compiler_directives=debug, build_dir=out, force=True, quiet=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pyx", PYX, ids=[p.stem for p in PYX])
def test_every_module_translates_with_the_debug_checks_on(pyx, tmp_path):
    res = subprocess.run([sys.executable, "-c", _TRANSLATE, str(pyx.relative_to(ROOT)), str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert list(tmp_path.rglob(f"{pyx.stem}.c")), "no C file was produced"


def test_make_clean_forgets_the_install_stamp():
    makefile = (ROOT / "Makefile").read_text()
    clean = re.search(r"^clean:\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "$(STAMP)" in clean and "$(XSTAMP)" in clean  # else `make test` after `make clean` imports no core
    assert re.search(r"-name '\*\.so'", clean)
