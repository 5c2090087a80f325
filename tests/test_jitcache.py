"""quillcache._jitcache: a cached Numba kernel is recompiled when a module it compiles in changes.

Each case builds a small package of modules in a temporary folder and imports it in fresh
interpreters (Numba's cache lives on disk, so only a new process shows what the cache serves).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE = """
from numba import njit

@njit
def value():
    return {value}
"""

MID = """
from numba import njit
from quillcache._jitcache import guard_cache
import qc_jit_base

@njit(cache=True)
def mid():
    return qc_jit_base.value() * 10

guard_cache(__name__, "qc_jit_base")
"""

TOP = """
from numba import njit
from quillcache._jitcache import guard_cache
import qc_jit_mid

@njit(cache=True)
def top():
    return qc_jit_mid.mid() + 1

guard_cache(__name__, "qc_jit_mid")
"""

PROBE = """
import json, importlib, sys
mod = importlib.import_module(sys.argv[1])
fn = getattr(mod, sys.argv[2])
out = fn()
print(json.dumps({"value": out, "hits": sum(fn.stats.cache_hits.values()),
                  "misses": sum(fn.stats.cache_misses.values())}))
"""


def _write(folder: Path, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(text))


def _run(folder: Path, module: str, function: str) -> dict:
    env = {"PYTHONPATH": f"{folder}:{ROOT}", "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, module, function], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cached_kernel_is_recompiled_when_the_helper_module_it_calls_changes(tmp_path):
    _write(tmp_path, "qc_jit_base", BASE.format(value=1))
    _write(tmp_path, "qc_jit_mid", MID)
    first = _run(tmp_path, "qc_jit_mid", "mid")
    assert first["value"] == 10 and first["misses"] == 1
    again = _run(tmp_path, "qc_jit_mid", "mid")
    assert again == {"value": 10, "hits": 1, "misses": 0}  # served from the cache while nothing changed
    _write(tmp_path, "qc_jit_base", BASE.format(value=2))  # only the helper's file changes
    changed = _run(tmp_path, "qc_jit_mid", "mid")
    assert changed["value"] == 20 and changed["misses"] == 1  # recompiled, not the stale cached kernel
    assert _run(tmp_path, "qc_jit_mid", "mid") == {"value": 20, "hits": 1, "misses": 0}


def test_a_change_two_modules_down_reaches_the_top_kernel(tmp_path):
    _write(tmp_path, "qc_jit_base", BASE.format(value=3))
    _write(tmp_path, "qc_jit_mid", MID)
    _write(tmp_path, "qc_jit_top", TOP)
    assert _run(tmp_path, "qc_jit_top", "top")["value"] == 31
    assert _run(tmp_path, "qc_jit_top", "top")["hits"] == 1
    _write(tmp_path, "qc_jit_base", BASE.format(value=4))
    assert _run(tmp_path, "qc_jit_top", "top")["value"] == 41


def test_the_package_kernels_declare_their_dependencies():
    """Every module with a cached kernel that imports another quillcache module's kernels guards its cache."""
    import quillcache.hitrate.bounds  # noqa: F401 (imports every hit-rate kernel module)
    import quillcache.kvquant._cpu  # noqa: F401
    import quillcache.planner._kernels  # noqa: F401
    from quillcache import _jitcache

    for name in ("quillcache.kvquant._cpu", "quillcache.hitrate.kernels", "quillcache.hitrate.kernels_quillhd",
                 "quillcache.hitrate.kernels_classic", "quillcache.hitrate.kernels_lrb",
                 "quillcache.hitrate.kernels_tinylfu", "quillcache.hitrate.bounds", "quillcache.planner._kernels"):
        assert name in _jitcache._CLOSURE, name
