"""Every ``numba.cuda`` kernel of ``quillcache.kvquant._cuda`` compiles to PTX for the H100/H200 (sm_90), and no
float multiply in it feeds a float add that ptxas could fuse into an FMA.

The simulator tests (``test_kvquant_kernels``) run the kernels' Python as Python, so they cannot see what only
the CUDA compiler rejects: ``max`` of two floats in ``_scalar.asym_scale`` compiled for the CPU and in the
simulator but not for a GPU (every int4/int2 quantize on a GPU would have failed; review of 2026-11-29,
/tmp/s35/kernels #1). Compiling to PTX needs libNVVM and libdevice (the CUDA toolkit), not a GPU or a driver: the
test finds them where the toolkit puts them and skips when there is none. It runs in a subprocess so that the
toolkit location it sets (``CUDA_HOME``) and the compute capability it answers for the absent device stay there.

The second check is the bit-identity claim: ``mul.f32`` and ``add.f32`` without a rounding suffix may be
contracted into one ``fma`` by ptxas (its default), which rounds once where the CPU kernels and the reference
round twice (#2 of the same review: the scale floor of a group of tiny values).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import json, sys, types
import numba.cuda.dispatcher as dispatcher
# no device here: the compute capability a device function is compiled for when a kernel calls it
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from numba import cuda, float32, int8, int32, int64, uint8, types as nt
from quillcache.kvquant import _cuda as K

def A(dt, nd):
    return nt.Array(dt, nd, "C")

# the argument types the launchers of _cuda.py pass (float32 tensors, int64 Python ints, np.float32 scalars)
SIGS = {
    "_amax_k": (A(float32, 3), A(float32, 2)),
    "_sym_scale_k": (A(float32, 2), float32, A(float32, 2)),
    "_int8_encode_k": (A(float32, 3), A(float32, 2), A(int8, 3)),
    "_int8_decode_k": (A(int8, 3), A(float32, 2), A(float32, 3)),
    "_fp8_encode_k": (A(float32, 3), A(float32, 2), A(uint8, 3)),
    "_fp8_decode_k": (A(uint8, 3), A(float32, 2), A(float32, 1), A(float32, 3)),
    "_minmax_k": (A(float32, 3), int64, int64, A(float32, 3), A(float32, 3)),
    "_asym_params_k": (A(float32, 3), A(float32, 3), float32, A(float32, 3), A(int32, 3)),
    "_asym_encode_k": (A(float32, 3), A(float32, 3), A(int32, 3), int64, int64, int64, A(uint8, 3)),
    "_asym_decode_k": (A(uint8, 3), A(float32, 3), A(int32, 3), int64, int64, A(float32, 3)),
    "_pack_k": (A(uint8, 1), int64, A(uint8, 1)),
    "_unpack_k": (A(uint8, 1), int64, A(uint8, 1)),
}
kernels = sorted(n for n, v in vars(K).items() if n.endswith("_k") and hasattr(v, "py_func"))
out = {"kernels": kernels, "ptx": {}, "errors": {}, "controls": {}}

def fused(x, y, z, out):  # positive controls: a product feeding an add, in one block and across a branch
    out[0] = x[0] * y[0] + z[0]

def split(x, y, z, out):
    p = x[0] * y[0]
    if p < z[0]:
        p = p + z[0]
    out[0] = p

for fn in (fused, split):
    out["controls"][fn.__name__], _ = cuda.compile_ptx(fn, (A(float32, 1),) * 4, cc=(9, 0))
for name in kernels:
    try:
        out["ptx"][name], _ = cuda.compile_ptx(getattr(K, name).py_func, SIGS[name], cc=(9, 0))
    except Exception as e:
        out["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
json.dump(out, sys.stdout)
"""


def _toolkit() -> tuple[Path, Path] | None:
    """(libnvvm.so, the libdevice folder) of a CUDA toolkit on this machine, or None."""
    homes = [Path(p) for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if p]
    homes += sorted(Path("/usr/local").glob("cuda*"), reverse=True) + [Path("/usr/lib/cuda")]
    for home in homes:
        libdevice = home / "nvvm" / "libdevice"
        for lib in (home / "nvvm" / "lib64" / "libnvvm.so", home / "lib" / "libnvvm.so",
                    home / "lib64" / "libnvvm.so"):
            if lib.exists() and (libdevice / "libdevice.10.bc").exists():
                return lib, libdevice
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    found = _toolkit()
    if found is None:
        pytest.skip("no CUDA toolkit (libNVVM and libdevice) on this machine: PTX cannot be compiled")
    lib, libdevice = found
    home = tmp_path_factory.mktemp("cudahome")  # the layout numba looks for, whatever the toolkit's version
    (home / "nvvm" / "lib64").mkdir(parents=True)
    (home / "nvvm" / "lib64" / "libnvvm.so").symlink_to(lib)
    (home / "nvvm" / "libdevice").symlink_to(libdevice)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(CUDA_HOME=str(home), NUMBA_CUDA_USE_NVIDIA_BINDING="0")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_every_kernel_compiles_for_sm90(compiled):
    assert len(compiled["kernels"]) >= 12, compiled["kernels"]  # a kernel added without a signature fails here
    assert compiled["errors"] == {}, compiled["errors"]


_FLOAT_REG = r"%f\d+"


def _contractible_pairs(ptx: str) -> list[str]:
    """Lines that round a product and a sum once: an ``fma``/``mad`` NVVM already fused (float, any rounding
    suffix), or an ``add``/``sub`` (f32/f64, no rounding suffix) reading a register that a ``mul`` without one
    wrote, which ptxas may fuse."""
    products: set[str] = set()
    found = []
    for line in ptx.splitlines():
        if re.match(r"\s*(?:fma|mad)(?:\.[a-z]+)*\.f(?:32|64)\s", line):
            found.append(line.strip())
            continue
        m = re.match(r"\s*mul\.f(?:32|64)\s+(%f[d]?\d+),", line)
        if m:
            products.add(m.group(1))
            continue
        m = re.match(r"\s*(?:add|sub)\.f(?:32|64)\s+%f[d]?\d+,\s*(.*);", line)
        if m and any(op.strip() in products for op in m.group(1).split(",")):
            found.append(line.strip())
    return found


def test_no_float_product_feeds_an_add_that_ptxas_could_fuse(compiled):
    pairs = {name: _contractible_pairs(ptx) for name, ptx in compiled["ptx"].items()}
    assert {name: p for name, p in pairs.items() if p} == {}


def test_the_pair_check_flags_both_positive_controls(compiled):
    """A product feeding a sum in one block (NVVM writes ``fma.rn.f32`` itself) and across a branch (separate
    ``mul.f32`` / ``add.f32``, which ptxas may fuse): the check must see both, or it proves nothing."""
    for name, ptx in compiled["controls"].items():
        assert _contractible_pairs(ptx), (name, ptx[-1500:])


def test_the_pair_check_sees_a_contractible_pair():
    ptx = "mul.f32 %f3, %f1, 0f35800000;\n add.f32 %f4, %f3, 0f00000001;\n mul.rn.f32 %f5, %f1, %f2;\n" \
          "add.f32 %f6, %f5, %f1;"
    assert _contractible_pairs(ptx) == ["add.f32 %f4, %f3, 0f00000001;"]
    assert _contractible_pairs("fma.rn.f32 %f4, %f1, %f2, %f3;\n mad.lo.s32 %r1, %r2, %r3, %r4;") == \
        ["fma.rn.f32 %f4, %f1, %f2, %f3;"]
