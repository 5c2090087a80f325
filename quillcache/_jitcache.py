"""Numba's on-disk cache, made to notice edits to the modules a kernel module compiles in.

Numba keys a function cached with ``cache=True`` on the bytes of the one file that defines it.
A kernel that calls ``@njit`` helpers from another file (or reads another module's global
arrays, which are frozen into the compiled code) is therefore served from the cache after that
other file changed: an edited helper silently keeps its old behaviour in every kernel that uses
it until the kernel's own file changes. A fresh checkout has no cache; an existing checkout
(``pip install -e``) that pulls such an edit does.

``guard_cache(__name__, *dependency_names)``, called at the END of a kernel module (after its
dispatchers exist, before any of them has run), closes that gap:

- the module's closure digest is SHA-256 over its own source and, for each dependency module, that
  module's closure digest if it was guarded (so dependencies count transitively) or else its
  source's digest;
- the digest is recorded beside the module's cache files (``<cache dir>/<module file
  stem>.deps.sha256``); when the recorded digest differs (or is missing while the module has cached
  functions), every cached function of the module is flushed (Numba's ``Cache.flush``: an empty
  index, so the next call compiles and re-caches) before the new digest is written.

Invariant: a cached kernel is only ever loaded when the module and every module it declares
(transitively) are byte-for-byte the ones it was compiled from. The dependencies are declared
by hand: a module whose kernels call into, or read globals of, another quillcache module lists it.
A cache directory that cannot be written is left alone (Numba does not cache there either).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import types
from pathlib import Path

__all__ = ["closure_digest", "guard_cache"]

_CLOSURE: dict[str, str] = {}  # module name -> closure digest (hex), for modules already guarded
STAMP_SUFFIX = ".deps.sha256"


def _source_digest(module: types.ModuleType) -> str:
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()


def closure_digest(module_name: str) -> str:
    """The digest ``guard_cache`` recorded for a guarded module (else its source's digest)."""
    return _CLOSURE.get(module_name) or _source_digest(sys.modules[module_name])


def _cached_dispatchers(module: types.ModuleType) -> list:
    from numba.core.caching import FunctionCache
    from numba.core.dispatcher import Dispatcher

    return [v for v in vars(module).values()
            if isinstance(v, Dispatcher) and isinstance(getattr(v, "_cache", None), FunctionCache)
            and getattr(v.py_func, "__module__", None) == module.__name__]


def guard_cache(module_name: str, *dependency_names: str) -> str:
    """Flush ``module_name``'s cached kernels if it or a declared dependency changed; its closure digest."""
    module = sys.modules[module_name]
    h = hashlib.sha256(_source_digest(module).encode())
    for name in sorted(dependency_names):
        importlib.import_module(name)
        h.update(f"\0{name}\0{closure_digest(name)}".encode())
    digest = h.hexdigest()
    _CLOSURE[module_name] = digest
    dispatchers = _cached_dispatchers(module)
    if not dispatchers:
        return digest
    try:
        cache_dir = Path(dispatchers[0]._cache._cache_path)
        stamp = cache_dir / (Path(module.__file__).stem + STAMP_SUFFIX)
        try:
            recorded = stamp.read_text().strip()
        except FileNotFoundError:
            recorded = ""
        if recorded == digest:
            return digest
        for d in dispatchers:
            d._cache.flush()
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, stamp)
    except OSError:
        pass  # an unwritable cache directory: Numba does not cache there either
    return digest
