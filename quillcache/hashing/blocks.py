"""Block hashes: the Dynamo router chain (XXH3-64) and a keyed BLAKE2b chain for tenant scopes.

Dynamo-compatible chain (REFERENCE section 1), bit-identical to a per-block loop over ``xxhash``:

- tokens are laid out as little-endian uint32; only FULL blocks are hashed (a partial trailing
  block is ignored: 10 tokens at block size 16 give no hash);
- ``local_hash[i] = xxh3_64(le_u32(tokens[i*bs:(i+1)*bs]), seed)``;
- ``seq_hash[0] = local_hash[0]``, ``seq_hash[i] = xxh3_64(le_u64(seq_hash[i-1]) || le_u64(local_hash[i]), 1337)``;
- ``seed = 1337 + xxh3_64(lora, seed=0) + xxh3_64(namespace, seed=1)`` wrapping mod 2**64, where an
  empty or missing LoRA name / namespace omits its term. The mixed seed enters the per-block
  content hash; the 16-byte chain step is always seeded with 1337 (REFERENCE section 1, and what
  Dynamo's ``compute_seq_hash_for_block`` does), so a LoRA/namespace still changes every sequence
  hash through the chained local hashes.

Keyed chain (``salted_hash_blocks``): ``root = BLAKE2b-256[key, person="qc-salt-root"](le_u32(bs) ||
le_u32(len(salt)) || salt)`` and ``d[i] = BLAKE2b-256[key, person="qc-salt-block"](d[i-1] || le_u32(block_i))``
with ``d[-1] = root``: each digest commits to the key, the salt, the block size and the whole prefix
through the FULL 32-byte parent digest; the u64 form is the first 8 digest bytes, little-endian.

Invariants:
- Every public function validates its input before any compiled code runs and raises
  ``TypeError`` (wrong type / dtype) or ``ValueError`` (shape, range, size) naming the value.
  Secret keys are never echoed in messages; only their type and length are.
- Token input: any 1-D integer array or sequence with values in ``[0, 2**32)``. Non-contiguous,
  non-uint32 or byte-swapped arrays are COPIED to a contiguous native uint32 array (never refused);
  a contiguous native uint32 array is used as is. Inputs are never modified.
- Returned arrays are fresh ``uint64`` arrays owned by the caller.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Sequence, Union

import numpy as np
import xxhash

from quillcache._checks import check_int
from quillcache.hashing import _xxh3 as _k

__all__ = [
    "DYNAMO_BASE_SEED",
    "MAX_BLOCK_SIZE",
    "as_token_array",
    "hash_blocks",
    "hash_blocks_batch",
    "hash_seed",
    "local_hashes",
    "salted_block_digests",
    "salted_hash_blocks",
    "xxh3_64",
]

DYNAMO_BASE_SEED = _k.DYNAMO_BASE_SEED  # 1337
MAX_BLOCK_SIZE = 65536
MAX_TOKEN = 2**32 - 1
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64
MAX_SALT_BYTES = 1024
SALTED_DIGEST_BYTES = 32
_CHUNK_TOKENS = 1 << 17  # scratch size for gathering ragged prompts (1 MiB of int64)
_U64_MAX = 2**64 - 1
_PERSON_ROOT = b"qc-salt-root"
_PERSON_BLOCK = b"qc-salt-block"

TokensLike = Union[np.ndarray, Sequence[int]]


# --------------------------------------------------------------------------- validation
def _check_name(param: str, value: object) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise TypeError(f"{param} must be str or None, got {type(value).__name__} {value!r:.80}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: not text that UTF-8 (so Dynamo's hash) can carry
        raise ValueError(f"{param}={value!r:.80} is not valid Unicode text: {e.reason} at index {e.start} "
                         f"({value[e.start]!r}); it cannot be encoded as UTF-8") from None


def check_block_size(block_size: object) -> int:
    """``block_size`` as an int in 1..65536, or TypeError/ValueError saying what it was."""
    return check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)


def _out_of_range_index(arr: np.ndarray) -> int:
    """Index of the first value of an integer array outside ``[0, 2**32)``, or -1."""
    if arr.shape[0] == 0:
        return -1
    signed = arr.dtype.kind == "i"
    wide = arr.dtype.itemsize > 4
    if not (signed or wide):
        return -1  # uint8/16/32 always fit
    # one reduction pass each, no temporaries; locate the culprit only on failure
    if (signed and arr.min() < 0) or (wide and arr.max() > MAX_TOKEN):
        bad = (arr < 0) | (arr > MAX_TOKEN) if signed else (arr > MAX_TOKEN)
        return int(np.argmax(bad))
    return -1


def _range_error(label: str, value: object) -> ValueError:
    return ValueError(f"{label}={value} is out of range; token ids must be in [0, 2**32)")


def _from_object_array(arr: np.ndarray, name: str) -> np.ndarray:
    out = np.empty(arr.shape[0], dtype=np.uint32)
    for i, v in enumerate(arr.tolist()):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}[{i}]={v!r:.80} is a {type(v).__name__}; token ids must be integers")
        if not 0 <= v <= MAX_TOKEN:
            raise _range_error(f"{name}[{i}]", v)
        out[i] = v
    return out


def as_token_array(tokens: TokensLike, *, name: str = "tokens") -> np.ndarray:
    """Validate ``tokens`` and return them as a 1-D contiguous native ``uint32`` array.

    Copies only when needed (other dtype, byte order or a non-contiguous view).
    """
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if isinstance(tokens, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"{name} must be a sequence of integer token ids, got {type(tokens).__name__}")
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{name} is not a 1-D sequence of integers ({exc})") from None
        if arr.ndim == 1 and arr.shape[0] == 0:  # [] reads as float64: an empty prompt
            return np.empty(0, dtype=np.uint32)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "O":
        return _from_object_array(arr, name)
    if kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got dtype {arr.dtype}")
    i = _out_of_range_index(arr)
    if i >= 0:
        raise _range_error(f"{name}[{i}]", arr[i])
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _as_offsets(offsets: object, n_tokens: int) -> np.ndarray:
    if isinstance(offsets, (str, bytes)):
        raise TypeError(f"offsets must be a 1-D integer array, got {type(offsets).__name__}")
    try:
        arr = np.asarray(offsets)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"offsets is not a 1-D sequence of integers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"offsets must be 1-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("offsets is empty; CSR offsets need n_prompts + 1 >= 1 entries, starting at 0")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"offsets must have an integer dtype, got dtype {arr.dtype}")
    if arr[0] != 0:
        raise ValueError(f"offsets[0]={arr[0]}; CSR offsets must start at 0")
    if arr[-1] != n_tokens:
        raise ValueError(f"offsets[-1]={arr[-1]} but there are {n_tokens} tokens; they must be equal")
    down = arr[1:] < arr[:-1]
    if down.any():
        i = int(np.argmax(down)) + 1
        raise ValueError(f"offsets must be non-decreasing; offsets[{i}]={arr[i]} < offsets[{i - 1}]={arr[i - 1]}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _check_seed(seed: object) -> int:
    return check_int("seed", seed, 0, _U64_MAX)


# --------------------------------------------------------------------------- XXH3 / Dynamo chain
def xxh3_64(data: bytes | bytearray | memoryview | np.ndarray, seed: int = 0) -> int:
    """XXH3-64 of ``data`` with ``seed`` (the Numba kernel; equals ``xxhash.xxh3_64_intdigest``)."""
    s = _check_seed(seed)
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError(f"data must hold plain numbers, got dtype {data.dtype}")
        arr = np.ascontiguousarray(data)
        if not arr.flags.writeable:
            arr = arr.copy()  # one compiled signature (writable buffers) instead of two
        buf = arr.reshape(-1).view(np.uint8)
    elif isinstance(data, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(bytearray(data), dtype=np.uint8)  # writable: one compiled signature
    else:
        raise TypeError(f"data must be bytes-like or a numpy array, got {type(data).__name__}")
    out = np.empty(1, dtype=np.uint64)
    _k.xxh3_64_ranges(
        buf,
        np.zeros(1, dtype=np.int64),
        np.array([buf.shape[0]], dtype=np.int64),
        np.array([s], dtype=np.uint64),
        out,
    )
    return int(out[0])


@functools.lru_cache(maxsize=1024)
def _seed_cached(lora_utf8: bytes, namespace_utf8: bytes) -> int:
    seed = DYNAMO_BASE_SEED
    if lora_utf8:
        seed += xxhash.xxh3_64_intdigest(lora_utf8, seed=0)
    if namespace_utf8:
        seed += xxhash.xxh3_64_intdigest(namespace_utf8, seed=1)
    return seed & _U64_MAX


def hash_seed(lora: str | None = None, namespace: str | None = None) -> int:
    """Dynamo's hash seed: ``1337 + xxh3_64(lora, 0) + xxh3_64(namespace, 1)`` mod 2**64.

    ``None`` or ``""`` omits a term, so ``hash_seed() == hash_seed("", "") == 1337``.
    """
    return _seed_cached(_check_name("lora", lora), _check_name("namespace", namespace))


def _run_csr(
    flat: np.ndarray,
    tok_offsets: np.ndarray,
    bs: int,
    seed: int,
    chained: bool,
    block_offsets: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    if block_offsets is None:
        block_offsets = np.zeros(tok_offsets.shape[0], dtype=np.int64)
        np.cumsum(np.diff(tok_offsets) // bs, out=block_offsets[1:])
    out = np.empty(int(block_offsets[-1]), dtype=np.uint64)
    if out.shape[0]:
        # REFERENCE section 1: the mixed seed seeds the block content hash; the chain step uses 1337.
        _k.hash_blocks_csr(
            flat.view(np.uint8), tok_offsets, block_offsets, bs, np.uint64(seed), np.uint64(DYNAMO_BASE_SEED), chained, out
        )
    return out, block_offsets


def _single(
    tokens: TokensLike, block_size: object, lora: str | None, namespace: str | None, chained: bool
) -> np.ndarray:
    bs = check_block_size(block_size)
    seed = hash_seed(lora, namespace)
    flat = as_token_array(tokens)
    n = flat.shape[0]
    if n < bs:
        return np.empty(0, dtype=np.uint64)
    offsets = np.array([0, n], dtype=np.int64)
    return _run_csr(flat, offsets, bs, seed, chained, np.array([0, n // bs], dtype=np.int64))[0]


def local_hashes(
    tokens: TokensLike, block_size: int, lora: str | None = None, namespace: str | None = None
) -> np.ndarray:
    """``uint64[n_full_blocks]``: XXH3-64 of each full block's le_u32 bytes (not chained)."""
    return _single(tokens, block_size, lora, namespace, chained=False)


def hash_blocks(
    tokens: TokensLike, block_size: int, lora: str | None = None, namespace: str | None = None
) -> np.ndarray:
    """``uint64[n_full_blocks]``: Dynamo sequence hashes (each names its block and all before it)."""
    return _single(tokens, block_size, lora, namespace, chained=True)


def _ragged_to_csr(prompts: Sequence[TokensLike]) -> tuple[np.ndarray, np.ndarray]:
    """Validate a list of prompts and pack them into one contiguous uint32 array + offsets.

    Runs of same-dtype prompts are gathered ``_CHUNK_TOKENS`` at a time into a reused scratch
    buffer, range-checked there and cast into the output: the only fresh memory written is
    the uint32 result (fresh pages cost more than the copy itself).
    """
    arrays: list[np.ndarray] = []
    for j, p in enumerate(prompts):
        if isinstance(p, np.ndarray) and p.ndim == 1 and p.dtype.kind in "iu":
            arrays.append(p)
        else:
            arrays.append(as_token_array(p, name=f"prompts[{j}]"))
    n = len(arrays)
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=n)
    np.cumsum(offsets, out=offsets)
    flat = np.empty(int(offsets[-1]), dtype=np.uint32)
    scratch: dict[np.dtype, np.ndarray] = {}
    i = 0
    while i < n:
        dt = arrays[i].dtype
        j = i + 1
        while j < n and arrays[j].dtype == dt and offsets[j + 1] - offsets[i] <= _CHUNK_TOKENS:
            j += 1
        a0, a1 = int(offsets[i]), int(offsets[j])
        dst = flat[a0:a1]
        needs_check = dt.kind == "i" or dt.itemsize > 4
        if j == i + 1:
            src = arrays[i]
        elif needs_check:
            buf = scratch.get(dt)
            if buf is None:
                buf = scratch[dt] = np.empty(_CHUNK_TOKENS, dtype=dt)
            src = np.concatenate(arrays[i:j], out=buf[: a1 - a0])
        else:  # uint8/16/32: every value fits, cast while gathering
            np.concatenate(arrays[i:j], out=dst, casting="unsafe")
            i = j
            continue
        if needs_check:
            bad = _out_of_range_index(src)
            if bad >= 0:
                g = a0 + bad
                jj = int(np.searchsorted(offsets, g, side="right")) - 1
                raise _range_error(f"prompts[{jj}][{g - int(offsets[jj])}]", src[bad])
        np.copyto(dst, src, casting="unsafe")
        i = j
    return flat, offsets


def hash_blocks_batch(
    prompts: Sequence[TokensLike] | tuple[TokensLike, TokensLike],
    block_size: int,
    lora: str | None = None,
    namespace: str | None = None,
    *,
    chained: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Hash a ragged batch of prompts in ONE compiled call.

    ``prompts`` is either a ``list`` (any non-tuple sequence) of 1-D token arrays/lists, or a
    ``tuple`` ``(flat_tokens, offsets)`` in CSR form (prompt ``j`` is
    ``flat_tokens[offsets[j]:offsets[j+1]]``; offsets start at 0, never decrease, end at
    ``len(flat_tokens)``). Returns ``(hashes: uint64[total_blocks], block_offsets:
    int64[n_prompts + 1])`` so prompt ``j``'s hashes are ``hashes[block_offsets[j]:block_offsets[j+1]]``.
    ``chained=False`` returns local (unchained) block hashes instead of sequence hashes.
    """
    bs = check_block_size(block_size)
    seed = hash_seed(lora, namespace)
    if not isinstance(chained, (bool, np.bool_)):
        raise TypeError(f"chained must be a bool, got {type(chained).__name__}")
    if isinstance(prompts, tuple):
        if len(prompts) != 2:
            raise TypeError(
                f"a tuple means CSR form (flat_tokens, offsets), got a tuple of {len(prompts)} items; "
                "pass a list for a list of prompts"
            )
        flat = as_token_array(prompts[0], name="flat_tokens")
        offsets = _as_offsets(prompts[1], flat.shape[0])
    elif isinstance(prompts, np.ndarray):
        raise TypeError(
            f"prompts must be a list of 1-D token arrays or a (flat_tokens, offsets) tuple, "
            f"got a numpy array of shape {prompts.shape}"
        )
    elif isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a list of token sequences or a (flat, offsets) tuple, got {type(prompts).__name__}"
        )
    else:
        flat, offsets = _ragged_to_csr(prompts)
    return _run_csr(flat, offsets, bs, seed, bool(chained))


# --------------------------------------------------------------------------- keyed BLAKE2b chain
def _check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    k = bytes(key)
    if not MIN_KEY_BYTES <= len(k) <= MAX_KEY_BYTES:
        raise ValueError(f"key is {len(k)} bytes; expected {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
    return k


def _check_salt(salt: object) -> bytes:
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__} {salt!r:.80}")
    s = bytes(salt)
    if len(s) > MAX_SALT_BYTES:
        raise ValueError(f"salt is {len(s)} bytes; at most {MAX_SALT_BYTES} allowed")
    return s


def salted_block_digests(tokens: TokensLike, block_size: int, key: bytes, *, salt: bytes = b"") -> np.ndarray:
    """``uint8[n_full_blocks, 32]``: the full keyed BLAKE2b-256 chain digests (see module doc)."""
    bs = check_block_size(block_size)
    k = _check_key(key)
    s = _check_salt(salt)
    flat = as_token_array(tokens)
    n_blocks = flat.shape[0] // bs
    out = np.empty((n_blocks, SALTED_DIGEST_BYTES), dtype=np.uint8)
    if n_blocks == 0:
        return out
    parent = hashlib.blake2b(
        struct.pack("<II", bs, len(s)) + s, key=k, digest_size=SALTED_DIGEST_BYTES, person=_PERSON_ROOT
    ).digest()
    base = hashlib.blake2b(key=k, digest_size=SALTED_DIGEST_BYTES, person=_PERSON_BLOCK)
    data = memoryview(flat.astype("<u4", copy=False)).cast("B")
    block_bytes = 4 * bs
    for i in range(n_blocks):
        h = base.copy()
        h.update(parent)
        h.update(data[i * block_bytes : (i + 1) * block_bytes])
        parent = h.digest()
        out[i] = np.frombuffer(parent, dtype=np.uint8)
    return out


def salted_hash_blocks(tokens: TokensLike, block_size: int, key: bytes, *, salt: bytes = b"") -> np.ndarray:
    """``uint64[n_full_blocks]``: the first 8 bytes (LE) of each keyed chain digest.

    Same key (and salt) -> same chain in every process; another key -> an unrelated chain for the
    same prefix, so tenant-scoped keys never collide with the public Dynamo hashes by design.
    """
    digests = salted_block_digests(tokens, block_size, key, salt=salt)
    return np.ascontiguousarray(digests[:, :8]).view("<u8").reshape(-1).astype(np.uint64)
