"""The kernel backends, by name: ``reference`` (NumPy, the specification), ``numba`` (CPU,
parallel) and ``cuda`` (``numba.cuda`` on CuPy arrays, or on NumPy arrays under Numba's CUDA
simulator). Every backend computes bit-identical results (the tests check it on Hypothesis inputs).

A backend is a ``KernelBackend``: eight functions over C-contiguous, finite float32
``(tokens, heads, head_dim)`` arrays whose shapes and group sizes the codecs have already checked
(the functions trust their arguments). Entries are lazy: ``numba.cuda`` is imported only when the
``cuda`` backend is first asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from quillcache.registry import Registry

__all__ = ["KERNELS", "KernelBackend"]

_FUNCTIONS = ("int8_quantize", "int8_dequantize", "fp8_quantize", "fp8_dequantize", "asym_quantize",
              "asym_dequantize", "pack_bits", "unpack_bits")


@dataclass(frozen=True, kw_only=True)
class KernelBackend:
    """The functions one backend implements (signatures as in ``reference.py``)."""

    name: str
    int8_quantize: Callable
    int8_dequantize: Callable
    fp8_quantize: Callable
    fp8_dequantize: Callable
    asym_quantize: Callable
    asym_dequantize: Callable
    pack_bits: Callable
    unpack_bits: Callable

    @classmethod
    def from_module(cls, name: str, module: ModuleType) -> "KernelBackend":
        return cls(name=name, **{f: getattr(module, f) for f in _FUNCTIONS})


def _load(name: str, module: str) -> Callable[[], KernelBackend]:
    def load() -> KernelBackend:
        import importlib

        return KernelBackend.from_module(name, importlib.import_module(module))

    return load


KERNELS: Registry[Callable[[], KernelBackend]] = Registry("kvquant kernel backend")
KERNELS.register("reference", _load("reference", "quillcache.kvquant.reference"))
KERNELS.register("numba", _load("numba", "quillcache.kvquant._cpu"))
KERNELS.register("cuda", _load("cuda", "quillcache.kvquant._cuda"))

_loaded: dict[str, KernelBackend] = {}


def backend(name: str) -> KernelBackend:
    """The backend called ``name`` (imported on first use); unknown names list the registered ones."""
    got = _loaded.get(name)
    if got is None:
        got = _loaded[name] = KERNELS[name]()
    return got
