"""Batched Dynamo block hashing (Numba XXH3) vs the natural per-block ``xxhash`` loop.

Same prompts, same run, interleaved repetitions. The baseline is what one would write in
Python: per block ``tokens[a:b].astype('<u4').tobytes()`` -> ``xxh3_64_intdigest`` and, for the
chain, ``struct.pack('<QQ', prev, local)`` -> ``xxh3_64_intdigest``. Every batched result is
checked bit-for-bit against the loop before timing. JIT compile time is excluded: each
kernel is called once (warm-up) before the timed repetitions.

Subjects (metric ``blocks_per_s``, higher is better; ``ratio`` = speed-up over the loop):
- ``batch_list``: ``hash_blocks_batch(list_of_prompts, ...)`` from the prompts as given
  (int64 arrays): validation, uint32 conversion and concatenation are inside the timing.
- ``batch_csr``: ``hash_blocks_batch((flat_u32, offsets), ...)``: the CSR form, built once
  outside the timing (as a tokenizer that emits CSR would hand it over).
- ``per_prompt``: ``hash_blocks(prompt, ...)`` once per prompt (Python-level dispatch per prompt).
- ``prange_csr`` (full mode only): a bench-only ``parallel=True`` copy of the CSR kernel, to
  record whether multithreading helps on this machine.
- ``blake2b_keyed_chain`` (16-token blocks): the tenant-scoped keyed chain, for scale.
"""

from __future__ import annotations

import gc
import struct
import time
from typing import Callable

import numpy as np
import xxhash
from numba import njit, prange

from experiments.microbench import bench_main
from quillcache.hashing import blocks as hashing
from quillcache.hashing import _xxh3 as _k
from quillcache.results import SummaryRow, print_table, spread, write_raw, write_summary

NAME = "hashing"
SEED = hashing.DYNAMO_BASE_SEED

# (block_size_tokens, n_prompts, max_prompt_tokens) per mode; prompt lengths are uniform in
# [block_size, max_prompt_tokens] so most prompts end in a partial block.
FULL_CASES = [(16, 2000, 4096), (512, 600, 16384)]
QUICK_CASES = [(16, 300, 1024), (512, 60, 4096)]
FULL_REPS = 7
QUICK_REPS = 3
RNG_SEED = 20240611


def loop_hash_blocks(prompts: list[np.ndarray], block_size: int, seed: int = SEED) -> list[int]:
    """The natural Python implementation (the baseline): one ``xxhash`` call per block and step."""
    out: list[int] = []
    h3 = xxhash.xxh3_64_intdigest
    pack = struct.pack
    for tokens in prompts:
        prev = None
        for a in range(0, len(tokens) - block_size + 1, block_size):
            local = h3(tokens[a : a + block_size].astype("<u4").tobytes(), seed=seed)
            prev = local if prev is None else h3(pack("<QQ", prev, local), seed=seed)
            out.append(prev)
    return out


@njit(parallel=True, cache=True)
def _prange_csr(buf, tok_offsets, block_offsets, block_size, seed, out):  # pragma: no cover - bench only
    n = block_offsets.shape[0] - 1
    n_chunks = 64
    sec_bytes = np.empty(_k.SECRET_SIZE, dtype=np.uint8)
    sec64 = np.empty(_k.SECRET_TABLE_LEN, dtype=np.uint64)
    _k._custom_secret_table(seed, sec_bytes, sec64)
    for c in prange(n_chunks):
        acc = np.empty(8, dtype=np.uint64)
        for j in range(c * n // n_chunks, (c + 1) * n // n_chunks):
            byte0 = 4 * tok_offsets[j]
            b0 = block_offsets[j]
            prev = np.uint64(0)
            for k in range(block_offsets[j + 1] - b0):
                h = _k._xxh3_64(buf, byte0 + k * 4 * block_size, 4 * block_size, seed, sec64, acc)
                if k > 0:
                    h = _k._xxh3_64_pair(prev, h, seed)
                out[b0 + k] = h
                prev = h


def _make_prompts(rng: np.random.Generator, n_prompts: int, block_size: int, max_tokens: int) -> list[np.ndarray]:
    lengths = rng.integers(block_size, max_tokens, size=n_prompts, endpoint=True)
    return [rng.integers(0, 2**32, size=int(n), dtype=np.int64) for n in lengths]


def _time(fn: Callable[[], object]) -> float:
    """Seconds for one call, with the cyclic GC paused (as ``timeit`` does) for every subject."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _row(subject: str, bs: int, samples_s: list[float], n_blocks: int, base: float | None, notes: str) -> SummaryRow:
    rates = [n_blocks / s for s in samples_s]
    sp = spread(rates)
    extra = f"{n_blocks} blocks"
    return SummaryRow.from_spread(
        sp,
        metric="blocks_per_s",
        subject=subject,
        params={"block_tokens": bs},
        unit="blocks/s",
        baseline="xxhash_loop" if base is not None else "",
        baseline_value=base if base is not None else float("nan"),
        n=len(samples_s),
        notes=f"{extra}; {notes}",
    )


def run(quick: bool = False, results_root: str | None = None) -> list[SummaryRow]:
    t_start = time.monotonic()
    cases = QUICK_CASES if quick else FULL_CASES
    reps = QUICK_REPS if quick else FULL_REPS
    rng = np.random.default_rng(RNG_SEED)
    rows: list[SummaryRow] = []
    raw: list[tuple] = []
    common = (
        "median of reps; JIT compile excluded (warm-up call before timing); interleaved reps; GC paused while timing"
    )
    for bs, n_prompts, max_tokens in cases:
        prompts = _make_prompts(rng, n_prompts, bs, max_tokens)
        flat = np.concatenate(prompts).astype(np.uint32)
        offsets = np.zeros(n_prompts + 1, dtype=np.int64)
        np.cumsum([len(p) for p in prompts], out=offsets[1:])
        n_blocks = int(sum(len(p) // bs for p in prompts))

        expected = np.array(loop_hash_blocks(prompts, bs), dtype=np.uint64)
        subjects: dict[str, Callable[[], object]] = {
            "batch_list": lambda: hashing.hash_blocks_batch(prompts, bs),
            "batch_csr": lambda: hashing.hash_blocks_batch((flat, offsets), bs),
            "per_prompt": lambda: [hashing.hash_blocks(p, bs) for p in prompts],
        }
        # warm up (compile / load the JIT cache) and check bit-identity before timing
        assert np.array_equal(subjects["batch_list"]()[0], expected), "batch_list differs from the xxhash loop"
        assert np.array_equal(subjects["batch_csr"]()[0], expected), "batch_csr differs from the xxhash loop"
        assert np.array_equal(np.concatenate(subjects["per_prompt"]()), expected), "per_prompt differs"
        if not quick:
            block_offsets = hashing.hash_blocks_batch((flat, offsets), bs)[1]
            par_out = np.empty(n_blocks, dtype=np.uint64)
            buf = flat.view(np.uint8)

            def _par() -> None:
                _prange_csr(buf, offsets, block_offsets, bs, np.uint64(SEED), par_out)

            _par()
            assert np.array_equal(par_out, expected), "prange kernel differs from the xxhash loop"
            subjects["prange_csr"] = _par
        if bs == 16:
            key = bytes(range(32))
            subjects["blake2b_keyed_chain"] = lambda: [hashing.salted_hash_blocks(p, bs, key) for p in prompts]
            subjects["blake2b_keyed_chain"]()

        samples: dict[str, list[float]] = {"xxhash_loop": [], **{s: [] for s in subjects}}
        for rep in range(reps):
            dt = _time(lambda: loop_hash_blocks(prompts, bs))
            samples["xxhash_loop"].append(dt)
            raw.append((bs, "xxhash_loop", rep, dt, n_blocks, n_blocks / dt))
            for name, fn in subjects.items():
                dt = _time(fn)
                samples[name].append(dt)
                raw.append((bs, name, rep, dt, n_blocks, n_blocks / dt))

        base = spread([n_blocks / s for s in samples["xxhash_loop"]])["median"]
        rows.append(_row("xxhash_loop", bs, samples["xxhash_loop"], n_blocks, None, f"baseline; {common}"))
        for name in subjects:
            rows.append(_row(name, bs, samples[name], n_blocks, base, common))

    write_summary(f"microbench_{NAME}", rows, root=results_root, profile="quick" if quick else "full",
                  started_at=t_start)
    write_raw(
        f"microbench_{NAME}",
        "raw.csv",
        ("block_size", "subject", "rep", "seconds", "blocks", "blocks_per_s"),
        raw,
        root=results_root,
    )
    print_table(rows)
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """The speed-up over the same-run baseline of every row that has one (log scale)."""
    from pathlib import Path

    from experiments.plotstyle import speedup_chart
    from quillcache.results import read_summary

    name = f"microbench_{NAME}"
    return speedup_chart(read_summary(name, results_root), "Block hashing vs a per-block xxhash loop", Path(out_dir) / f"{name}.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
