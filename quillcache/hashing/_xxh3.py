"""XXH3-64 (with seed) in Numba, plus the block-hash chain kernels built on it.

This is a private module: use :mod:`quillcache.hashing.blocks`, which validates input first.

Invariants:
- ``xxh3_64_ranges`` returns, for every range, exactly ``xxhash.xxh3_64_intdigest(bytes, seed)``
  (xxHash 0.8 XXH3_64bits_withSeed): every length class (0, 1-3, 4-8, 9-16, 17-128, 129-240 and
  the >240 "long" path with stripes, accumulators, scrambling and the seeded custom secret of
  XXH3_initCustomSecret) is implemented, for any u64 seed and any byte offset.
- All hash arithmetic is on ``np.uint64`` values (constants included), so it wraps mod 2**64
  like C; the 64x64->128 multiply of XXH3_mul128_fold64 is done with 32-bit halves.
- Input is a ``uint8`` buffer (the byte view of little-endian uint32 tokens); 8- and 4-byte
  reads are single unaligned little-endian loads, so results do not depend on alignment.
- The kernels trust their arguments (offsets in range, block_size >= 1); the public wrapper
  checks them. Nothing here allocates per hash: scratch buffers are made once per kernel call.
  The two entry kernels release the GIL (``nogil=True``), so threads may hash concurrently.
- ``reference_local_hashes`` / ``reference_hash_blocks`` are the plain-Python specification
  of the Dynamo router chain (REFERENCE section 1) over the ``xxhash`` package.
"""

from __future__ import annotations

import struct
import sys
from typing import Sequence

import numpy as np
import xxhash
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# --------------------------------------------------------------------------- constants
_KSECRET_BYTES = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1c"
    "ded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea3"
    "71644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d"
    "8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce"
    "45cb3a8f95160428afd7fbcabb4b407e"
)
assert len(_KSECRET_BYTES) == 192

SECRET_SIZE = 192
# readLE64(secret + k) for every k in 0..184: every secret read becomes one table load.
SECRET_TABLE_LEN = SECRET_SIZE - 8 + 1


def _le64(buf: bytes, off: int) -> int:
    return int.from_bytes(buf[off : off + 8], "little")


def _le32(buf: bytes, off: int) -> int:
    return int.from_bytes(buf[off : off + 4], "little")


_M64 = (1 << 64) - 1
_U = np.uint64

P32_1 = _U(0x9E3779B1)
P32_2 = _U(0x85EBCA77)
P32_3 = _U(0xC2B2AE3D)
P64_1 = _U(0x9E3779B185EBCA87)
P64_2 = _U(0xC2B2AE3D27D4EB4F)
P64_3 = _U(0x165667B19E3779F9)
P64_4 = _U(0x85EBCA77C2B2AE63)
P64_5 = _U(0x27D4EB2F165667C5)
PRIME_MX1 = _U(0x165667919E3779F9)
PRIME_MX2 = _U(0x9FB21C651E98DF25)
M32 = _U(0xFFFFFFFF)
U0 = _U(0)
U8 = _U(8)
U16 = _U(16)
U24 = _U(24)
U28 = _U(28)
U29 = _U(29)
U32 = _U(32)
U33 = _U(33)
U35 = _U(35)
U37 = _U(37)
U40 = _U(40)
U47 = _U(47)
U49 = _U(49)
U56 = _U(56)

# Default-secret reads used by the short paths, folded once here (they are compile-time
# constants inside the kernels).
KSEC64 = np.array([_le64(_KSECRET_BYTES, k) for k in range(SECRET_TABLE_LEN)], dtype=np.uint64)
KS_LEN0 = _U(_le64(_KSECRET_BYTES, 56) ^ _le64(_KSECRET_BYTES, 64))
KS_1TO3 = _U(_le32(_KSECRET_BYTES, 0) ^ _le32(_KSECRET_BYTES, 4))
KS_4TO8 = _U(_le64(_KSECRET_BYTES, 8) ^ _le64(_KSECRET_BYTES, 16))
KS_9TO16_LO = _U(_le64(_KSECRET_BYTES, 24) ^ _le64(_KSECRET_BYTES, 32))
KS_9TO16_HI = _U(_le64(_KSECRET_BYTES, 40) ^ _le64(_KSECRET_BYTES, 48))
KSECRET = np.frombuffer(_KSECRET_BYTES, dtype=np.uint8).copy()
KSECRET.setflags(write=False)


# --------------------------------------------------------------------------- primitives
def _make_load(bits: int, result_type):
    """An intrinsic ``load(buf, i)``: the ``bits``-wide little-endian value at byte ``i``.

    One unaligned machine load (the target is little-endian, checked at import), so LLVM need
    not merge eight byte loads; bounds are not checked (the callers' offsets are validated).
    """

    @intrinsic
    def _load(typingctx, arr, idx):
        if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            i = context.cast(builder, args[1], sig.args[1], types.intp)
            ptr = builder.bitcast(builder.gep(ary.data, [i]), ir.IntType(bits).as_pointer())
            val = builder.load(ptr, align=1)
            if bits < 64:
                val = builder.zext(val, ir.IntType(64))
            return val

        return result_type(arr, idx), codegen

    return _load


if sys.byteorder != "little":  # pragma: no cover - every supported target is little-endian
    raise ImportError("quillcache.hashing._xxh3 assumes a little-endian machine")

# readLE64 / readLE32 (zero-extended to uint64) at a byte offset of a uint8 array.
_r64 = _make_load(64, types.uint64)
_r32 = _make_load(32, types.uint64)


@njit(cache=True)
def _swap32(x):
    return ((x & _U(0xFF)) << U24) | ((x & _U(0xFF00)) << U8) | ((x >> U8) & _U(0xFF00)) | ((x >> U24) & _U(0xFF))


@njit(cache=True)
def _swap64(x):
    return (
        ((x << U56) & _U(0xFF00000000000000))
        | ((x << U40) & _U(0x00FF000000000000))
        | ((x << U24) & _U(0x0000FF0000000000))
        | ((x << U8) & _U(0x000000FF00000000))
        | ((x >> U8) & _U(0x00000000FF000000))
        | ((x >> U24) & _U(0x0000000000FF0000))
        | ((x >> U40) & _U(0x000000000000FF00))
        | ((x >> U56) & _U(0x00000000000000FF))
    )


@njit(cache=True)
def _mul128_fold64(a, b):
    """Low 64 bits XOR high 64 bits of the 128-bit product, from 32-bit halves."""
    a_lo = a & M32
    a_hi = a >> U32
    b_lo = b & M32
    b_hi = b >> U32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> U32) + (hi_lo & M32) + lo_hi
    upper = (hi_lo >> U32) + (cross >> U32) + hi_hi
    lower = (cross << U32) | (lo_lo & M32)
    return lower ^ upper


@njit(cache=True)
def _xxh64_avalanche(h):
    h ^= h >> U33
    h *= P64_2
    h ^= h >> U29
    h *= P64_3
    h ^= h >> U32
    return h


@njit(cache=True)
def _xxh3_avalanche(h):
    h ^= h >> U37
    h *= PRIME_MX1
    h ^= h >> U32
    return h


@njit(cache=True)
def _rrmxmx(h, length):
    h ^= ((h << U49) | (h >> _U(15))) ^ ((h << U24) | (h >> U40))
    h *= PRIME_MX2
    h ^= (h >> U35) + length
    h *= PRIME_MX2
    return h ^ (h >> U28)


@njit(cache=True)
def _mix16b(b, i, sec_lo, sec_hi, seed):
    lo = _r64(b, i)
    hi = _r64(b, i + 8)
    return _mul128_fold64(lo ^ (sec_lo + seed), hi ^ (sec_hi - seed))


# --------------------------------------------------------------------------- length classes
@njit(cache=True)
def _len_0to16(b, start, n, seed):
    if n > 8:
        lo = _r64(b, start) ^ (KS_9TO16_LO + seed)
        hi = _r64(b, start + n - 8) ^ (KS_9TO16_HI - seed)
        acc = _U(n) + _swap64(lo) + hi + _mul128_fold64(lo, hi)
        return _xxh3_avalanche(acc)
    if n >= 4:
        s = seed ^ (_swap32(seed & M32) << U32)
        in1 = _r32(b, start)
        in2 = _r32(b, start + n - 4)
        keyed = (in2 + (in1 << U32)) ^ (KS_4TO8 - s)
        return _rrmxmx(keyed, _U(n))
    if n > 0:
        c1 = _U(b[start])
        c2 = _U(b[start + (n >> 1)])
        c3 = _U(b[start + n - 1])
        combined = (c1 << U16) | (c2 << U24) | c3 | (_U(n) << U8)
        return _xxh64_avalanche(combined ^ (KS_1TO3 + seed))
    return _xxh64_avalanche(seed ^ KS_LEN0)


@njit(cache=True)
def _len_17to128(b, start, n, seed):
    acc = _U(n) * P64_1
    end = start + n
    if n > 32:
        if n > 64:
            if n > 96:
                acc += _mix16b(b, start + 48, KSEC64[96], KSEC64[104], seed)
                acc += _mix16b(b, end - 64, KSEC64[112], KSEC64[120], seed)
            acc += _mix16b(b, start + 32, KSEC64[64], KSEC64[72], seed)
            acc += _mix16b(b, end - 48, KSEC64[80], KSEC64[88], seed)
        acc += _mix16b(b, start + 16, KSEC64[32], KSEC64[40], seed)
        acc += _mix16b(b, end - 32, KSEC64[48], KSEC64[56], seed)
    acc += _mix16b(b, start, KSEC64[0], KSEC64[8], seed)
    acc += _mix16b(b, end - 16, KSEC64[16], KSEC64[24], seed)
    return _xxh3_avalanche(acc)


@njit(cache=True)
def _len_129to240(b, start, n, seed):
    acc = _U(n) * P64_1
    for i in range(8):
        acc += _mix16b(b, start + 16 * i, KSEC64[16 * i], KSEC64[16 * i + 8], seed)
    # XXH3_SECRET_SIZE_MIN (136) - XXH3_MIDSIZE_LASTOFFSET (17) = 119
    acc_end = _mix16b(b, start + n - 16, KSEC64[119], KSEC64[127], seed)
    acc = _xxh3_avalanche(acc)
    for i in range(8, n // 16):
        # XXH3_MIDSIZE_STARTOFFSET = 3
        off = 16 * (i - 8) + 3
        acc_end += _mix16b(b, start + 16 * i, KSEC64[off], KSEC64[off + 8], seed)
    return _xxh3_avalanche(acc + acc_end)


@njit(cache=True)
def _accumulate_512(b, p, sec64, soff, acc):
    for i in range(8):
        data_val = _r64(b, p + 8 * i)
        data_key = data_val ^ sec64[soff + 8 * i]
        acc[i ^ 1] += data_val
        acc[i] += (data_key & M32) * (data_key >> U32)


@njit(cache=True)
def _hash_long(b, start, n, sec64, acc):
    """The >240-byte path; ``sec64`` is the LE64 table of the (custom) secret."""
    acc[0] = P32_3
    acc[1] = P64_1
    acc[2] = P64_2
    acc[3] = P64_3
    acc[4] = P64_4
    acc[5] = P32_2
    acc[6] = P64_5
    acc[7] = P32_1
    # 16 stripes of 64 bytes per block: (secret_size - stripe_len) / consume_rate
    nb_blocks = (n - 1) // 1024
    for blk in range(nb_blocks):
        base = start + blk * 1024
        for s in range(16):
            _accumulate_512(b, base + 64 * s, sec64, 8 * s, acc)
        for i in range(8):  # scramble with secret + secret_size - stripe_len
            a = acc[i]
            a ^= a >> U47
            a ^= sec64[128 + 8 * i]
            a *= P32_1
            acc[i] = a
    nb_stripes = ((n - 1) - 1024 * nb_blocks) // 64
    base = start + nb_blocks * 1024
    for s in range(nb_stripes):
        _accumulate_512(b, base + 64 * s, sec64, 8 * s, acc)
    # last stripe: secret + secret_size - stripe_len - XXH_SECRET_LASTACC_START (7) = 121
    _accumulate_512(b, start + n - 64, sec64, 121, acc)
    result = _U(n) * P64_1
    for i in range(4):  # mergeAccs at secret + XXH_SECRET_MERGEACCS_START (11)
        result += _mul128_fold64(acc[2 * i] ^ sec64[11 + 16 * i], acc[2 * i + 1] ^ sec64[19 + 16 * i])
    return _xxh3_avalanche(result)


@njit(cache=True)
def _custom_secret_table(seed, sec_bytes, sec64):
    """XXH3_initCustomSecret(kSecret, seed) into ``sec_bytes``, then its LE64 table."""
    for i in range(SECRET_SIZE // 16):
        lo = KSEC64[16 * i] + seed
        hi = KSEC64[16 * i + 8] - seed
        for k in range(8):
            sh = _U(8 * k)
            sec_bytes[16 * i + k] = np.uint8((lo >> sh) & _U(0xFF))
            sec_bytes[16 * i + 8 + k] = np.uint8((hi >> sh) & _U(0xFF))
    for k in range(SECRET_TABLE_LEN):
        sec64[k] = _r64(sec_bytes, k)


@njit(cache=True)
def _xxh3_64(b, start, n, seed, sec64, acc):
    """XXH3_64bits_withSeed of ``b[start:start+n]``; ``sec64`` must match ``seed``."""
    if n <= 16:
        return _len_0to16(b, start, n, seed)
    if n <= 128:
        return _len_17to128(b, start, n, seed)
    if n <= 240:
        return _len_129to240(b, start, n, seed)
    return _hash_long(b, start, n, sec64, acc)


@njit(cache=True)
def _xxh3_64_pair(a, c, seed):
    """XXH3-64 of the 16 bytes ``le_u64(a) || le_u64(c)`` (the chain step, 9..16 path)."""
    lo = a ^ (KS_9TO16_LO + seed)
    hi = c ^ (KS_9TO16_HI - seed)
    acc = U16 + _swap64(lo) + hi + _mul128_fold64(lo, hi)
    return _xxh3_avalanche(acc)


# --------------------------------------------------------------------------- entry kernels
@njit(cache=True, nogil=True)
def xxh3_64_ranges(buf, starts, lengths, seeds, out):
    """``out[i] = XXH3_64(buf[starts[i]:starts[i]+lengths[i]], seeds[i])``.

    ``buf`` is uint8, ``starts``/``lengths`` int64, ``seeds``/``out`` uint64; ranges must lie
    inside ``buf`` (unchecked).
    """
    sec_bytes = np.empty(SECRET_SIZE, dtype=np.uint8)
    sec64 = np.empty(SECRET_TABLE_LEN, dtype=np.uint64)
    acc = np.empty(8, dtype=np.uint64)
    have_seed = False
    cur_seed = U0
    for i in range(starts.shape[0]):
        n = lengths[i]
        seed = seeds[i]
        if n > 240 and (not have_seed or seed != cur_seed):
            _custom_secret_table(seed, sec_bytes, sec64)
            have_seed = True
            cur_seed = seed
        out[i] = _xxh3_64(buf, starts[i], n, seed, sec64, acc)


@njit(cache=True, nogil=True)
def hash_blocks_csr(buf, tok_offsets, block_offsets, block_size, seed, chain_seed, chained, out):
    """Block hashes of every prompt of a CSR token batch, in one call.

    ``buf`` is the uint8 view of the contiguous uint32 tokens; prompt ``j`` is tokens
    ``tok_offsets[j]:tok_offsets[j+1]`` and owns ``out[block_offsets[j]:block_offsets[j+1]]``
    (its full blocks only). ``chained=False`` gives local hashes (XXH3 with ``seed``), ``True``
    sequence hashes (the 16-byte chain step uses ``chain_seed``).
    """
    sec_bytes = np.empty(SECRET_SIZE, dtype=np.uint8)
    sec64 = np.empty(SECRET_TABLE_LEN, dtype=np.uint64)
    acc = np.empty(8, dtype=np.uint64)
    _custom_secret_table(seed, sec_bytes, sec64)
    block_bytes = 4 * block_size
    for j in range(block_offsets.shape[0] - 1):
        byte0 = 4 * tok_offsets[j]
        b0 = block_offsets[j]
        prev = U0
        for k in range(block_offsets[j + 1] - b0):
            h = _xxh3_64(buf, byte0 + k * block_bytes, block_bytes, seed, sec64, acc)
            if chained and k > 0:
                h = _xxh3_64_pair(prev, h, chain_seed)
            out[b0 + k] = h
            prev = h


# --------------------------------------------------------------------------- Python reference
DYNAMO_BASE_SEED = 1337  # seeds every chain step (and the local hashes, absent a LoRA/namespace)


def reference_local_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Plain-Python specification: ``xxh3_64(le_u32(block), seed)`` for each FULL block."""
    arr = np.asarray(tokens, dtype="<u4")
    n_blocks = len(arr) // block_size
    return [
        xxhash.xxh3_64_intdigest(arr[i * block_size : (i + 1) * block_size].tobytes(), seed=seed)
        for i in range(n_blocks)
    ]


def reference_hash_blocks(
    tokens: Sequence[int], block_size: int, seed: int, chain_seed: int | None = None
) -> list[int]:
    """Plain-Python specification of the Dynamo chain (sequence hashes) over ``xxhash``.

    ``seed`` (1337, or a LoRA/namespace seed) seeds each block's local hash; ``chain_seed`` seeds the
    16-byte ``parent || local`` step, by default :data:`DYNAMO_BASE_SEED` whatever ``seed`` is (as
    ``hash_blocks`` does and REFERENCE section 1 says).
    """
    cseed = DYNAMO_BASE_SEED if chain_seed is None else chain_seed
    out: list[int] = []
    for local in reference_local_hashes(tokens, block_size, seed):
        if out:
            local = xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=cseed)
        out.append(local)
    return out


def reference_custom_secret(seed: int) -> bytes:
    """XXH3_initCustomSecret(kSecret, seed) in plain Python (documents the long-path secret)."""
    parts = []
    for i in range(SECRET_SIZE // 16):
        lo = (_le64(_KSECRET_BYTES, 16 * i) + seed) & _M64
        hi = (_le64(_KSECRET_BYTES, 16 * i + 8) - seed) & _M64
        parts.append(struct.pack("<QQ", lo, hi))
    return b"".join(parts)
