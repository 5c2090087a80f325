"""Hit-rate-only replay of the prefix-aware block cache: ``simulate`` and ``HITRATE_POLICIES``.

``simulate(trace_or_arrays, policy, capacity_blocks)`` validates its input, converts a trace to
CSR arrays (``quillcache.hitrate.arrays``) and runs the Numba kernel of the policy
(``quillcache.hitrate.kernels``). Each kernel reproduces, hit for hit, the online policy class of
the same name driven by the plain-Python harness ``quillcache.hitrate.reference`` (tested).

Registries: the policies are ``quillcache.policies.POLICIES`` (``HITRATE_POLICIES`` is that same
object, kept as a name); this layer adds only ``HITRATE_KERNELS`` (policy name -> its Numba kernel
and the kernel-side options it takes, whose defaults are the online class's defaults). A policy can
be simulated once it has a kernel here. ``SEMI_ONLINE`` names the policies that see the requests
queued at the engine (``lookahead``): they are reported apart from online policies.

No future knowledge: only the ``belady`` and ``lookahead`` runners pass ``next_use`` to a kernel,
and only their classes get a next-use oracle from the harness. Tested on decisions, not hits: every
online policy object holds the same blocks after a trace prefix's last request whether it replays
the prefix alone or the whole trace (Belady and lookahead fail that check: the test's positive
control), and each kernel matches its object hit for hit (tested), which carries this to the kernels.
Equal hits on a prefix alone would prove nothing: Belady and lookahead have them too.

Capacity: a positive int number of blocks, or None for unlimited. Capacities at or above the
number of distinct blocks never evict, so they are run as exactly that many (same hits).
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from quillcache._checks import check_int
from quillcache.hitrate import kernels
from quillcache.hitrate.arrays import (
    TraceArrays,
    arrays_from_lists,
    arrays_from_requests,
    clamp_capacity,
    load_arrays,
    validate_arrays,
)
from quillcache.policies import POLICIES, EvictionPolicy, make_policy
from quillcache.policies.quillchain import period_refs
from quillcache.policies.tinylfu import DOORKEEPER_SEED, TinyLfuPolicy
from quillcache.registry import Registry
from quillcache.sketch.reference import MASK64, seed_key
from quillcache.traces.loader import TraceRequest

__all__ = ["HITRATE_KERNELS", "HITRATE_POLICIES", "SEMI_ONLINE", "HitRateKernel", "HitRateResult", "TraceArrays",
           "load_arrays", "make_hitrate_policy", "simulate"]

HITRATE_POLICIES = POLICIES  # the one policy registry (name -> online class)


@dataclass(frozen=True)
class HitRateKernel:
    """A policy's replay kernel: ``run(arrays, capacity_blocks, hits_out, options) -> hit blocks``.

    ``options``: the kernel-side options and their defaults (the online class's defaults);
    ``check(options)`` validates given option values, naming a bad one (None = nothing to check).
    Every value ``check`` accepts runs in ``run`` (the classes bound each int option so that it, and
    what the runner derives from it, fits the kernel's int64; a window or seed beyond is reduced to
    the equivalent value the class would use), with the online class's hits."""

    run: Callable[[TraceArrays, int, np.ndarray, dict], int]
    options: Mapping[str, object]
    check: Callable[[dict], None] | None = None


HITRATE_KERNELS: Registry[HitRateKernel] = Registry("hit-rate policy")


def make_hitrate_policy(name: str, **options) -> EvictionPolicy:
    """The online policy of a policy that has a hit-rate kernel (ValueError lists those names)."""
    HITRATE_KERNELS.get(name)
    return make_policy(name, **options)


def _check_by_building(policy: str, **harness: object) -> Callable[[dict], None]:
    """Option values are validated by building the online class once (it names the bad value)."""

    def check(options: dict) -> None:
        make_hitrate_policy(policy, **harness, **options)

    return check


def _online_defaults(policy: str, *names: str) -> dict[str, object]:
    """The online class's constructor defaults of the kernel-side options ``names``."""
    params = inspect.signature(POLICIES[policy]).parameters
    return {name: params[name].default for name in names}


def _check_belady(options: dict) -> None:
    if "bypass" in options and not isinstance(options["bypass"], (bool, np.bool_)):  # as BeladyPolicy takes it
        raise TypeError(f"bypass must be bool, got {options['bypass']!r}")


def _run_tinylfu(arrs: TraceArrays, cap: int, hits: np.ndarray, opts: dict) -> int:
    p = TinyLfuPolicy(capacity_keys=cap, window_ratio=opts["window_ratio"], protected_ratio=opts["protected_ratio"],
                      sample_factor=opts["sample_factor"], doorkeeper=opts["doorkeeper"])
    return kernels.tinylfu(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, p.window_cap, p.main_cap,
                           p.protected_cap, p.sample_size, p.sketch.width, p.sketch.depth, np.uint64(seed_key(0)),
                           p.doorkeeper_bits, np.uint64(seed_key(DOORKEEPER_SEED)))


def _hd_runner(classes: int, leaf_first: bool, fixed: dict | None = None,
               period_of: Callable[[int, int], int] | None = None):
    """The runner of a policy on the QuillHD kernel: ``classes`` and ``leaf_first`` fixed per policy;
    ``period_of(period, block_tokens)`` gives the period in references when the policy's option is
    in other units (QuillChain's ``period_refs``), as the policy class does."""
    fixed = fixed or {}

    def run(arrs: TraceArrays, cap: int, hits: np.ndarray, opts: dict) -> int:
        o = {**fixed, **opts}
        mode = {"adaptive": 0, "hd": 1, "lru": 2, "challenger": 3}[o["mode"]]
        period = int(o["period"]) if period_of is None else period_of(int(o["period"]), int(o["block_tokens"]))
        return kernels.quillhd(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, arrs.input_tokens,
                               int(o["block_tokens"]), period, float(o["decay"]), kernels.NUM_BUCKETS,
                               float(o["quantile"]), float(o["che_mult"]), mode, classes, leaf_first,
                               bool(o.get("admit", False)), bool(o.get("shared_rate", False)),
                               bool(o.get("second_chance", False)), bool(o.get("cap_period", False)),
                               o.get("start_rule", "hd") == "lru")

    return run


_run_quillhd = _hd_runner(kernels.CLS_PREFIX, False)


def _run_lrb(arrs: TraceArrays, cap: int, hits: np.ndarray, opts: dict) -> int:
    return kernels.lrb(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, arrs.input_tokens,
                       int(opts["block_tokens"]), int(opts["sample_size"]), int(opts["window_mult"]),
                       float(opts["learning_rate"]), np.uint64(int(opts["seed"]) & MASK64))  # LrbPolicy's counter


def _plain(kernel: Callable) -> Callable[[TraceArrays, int, np.ndarray, dict], int]:
    """A kernel that takes only the trace, the capacity and the output array."""
    return lambda arrs, cap, hits, opts: kernel(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits)


HITRATE_KERNELS.register("lru", HitRateKernel(_plain(kernels.lru), {}))
HITRATE_KERNELS.register("fifo", HitRateKernel(_plain(kernels.fifo), {}))
HITRATE_KERNELS.register("lfu", HitRateKernel(_plain(kernels.lfu), {}))
HITRATE_KERNELS.register("lengthaware", HitRateKernel(_plain(kernels.lengthaware), {}))
HITRATE_KERNELS.register("s3fifo", HitRateKernel(
    lambda arrs, cap, hits, opts: kernels.s3fifo(
        arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits, float(opts["small_ratio"]),
        float(opts["ghost_ratio"]), int(opts["move_to_main_threshold"])),
    _online_defaults("s3fifo", "small_ratio", "ghost_ratio", "move_to_main_threshold"), _check_by_building("s3fifo")))
HITRATE_KERNELS.register("tinylfu", HitRateKernel(
    _run_tinylfu, _online_defaults("tinylfu", "window_ratio", "protected_ratio", "sample_factor", "doorkeeper"),
    _check_by_building("tinylfu", capacity_keys=1)))
HITRATE_KERNELS.register("belady", HitRateKernel(
    lambda arrs, cap, hits, opts: kernels.belady(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits,
                                                 arrs.next_use, bool(opts["bypass"])),
    _online_defaults("belady", "bypass"), _check_belady))
HITRATE_KERNELS.register("quillhd", HitRateKernel(
    _run_quillhd, _online_defaults("quillhd", "mode", "period", "decay", "quantile", "che_mult", "block_tokens",
                                   "start_rule"),
    _check_by_building("quillhd")))
HITRATE_KERNELS.register("quillchain", HitRateKernel(
    _hd_runner(kernels.CLS_CHAIN, True, period_of=period_refs),
    _online_defaults("quillchain", "mode", "period", "decay", "quantile", "che_mult", "block_tokens", "admit",
                     "shared_rate", "second_chance", "cap_period", "start_rule"),
    _check_by_building("quillchain")))
HITRATE_KERNELS.register("lhd", HitRateKernel(
    _hd_runner(kernels.CLS_REUSE, False, {"mode": "hd", "block_tokens": 512}),
    _online_defaults("lhd", "period", "decay", "quantile", "che_mult"), _check_by_building("lhd")))
HITRATE_KERNELS.register("sieve", HitRateKernel(_plain(kernels.sieve), {}))
HITRATE_KERNELS.register("arc", HitRateKernel(_plain(kernels.arc), {}))
HITRATE_KERNELS.register("2q", HitRateKernel(
    lambda arrs, cap, hits, opts: kernels.twoq(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits,
                                               float(opts["kin_ratio"]), float(opts["kout_ratio"])),
    _online_defaults("2q", "kin_ratio", "kout_ratio"), _check_by_building("2q")))
HITRATE_KERNELS.register("lookahead", HitRateKernel(
    lambda arrs, cap, hits, opts: kernels.lookahead(arrs.req_offsets, arrs.blocks, arrs.num_unique, cap, hits,
                                                    arrs.next_use,
                                                    min(int(opts["window_requests"]), arrs.num_requests)),
    _online_defaults("lookahead", "window_requests"),
    _check_by_building("lookahead", next_use_oracle=lambda k: 0, window_end_oracle=lambda: 0)))
SEMI_ONLINE = frozenset({"lookahead"})  # see the queued requests: never reported beside online policies
HITRATE_KERNELS.register("lrb", HitRateKernel(
    _run_lrb, _online_defaults("lrb", "sample_size", "window_mult", "learning_rate", "seed", "block_tokens"),
    _check_by_building("lrb")))


@dataclass(frozen=True, eq=False)
class HitRateResult:
    policy: str
    capacity_blocks: int | None  # None = unlimited
    hit_blocks: int
    total_blocks: int
    hits_per_request: np.ndarray  # int32[R]
    elapsed_s: float  # the kernel's replay only (its JIT compile happens before, in a warm-up)

    @property
    def hit_rate(self) -> float:
        """Hit blocks over block references; NaN (not 0.0) for a trace with no block reference, where
        there is no rate (``quillcache hitrate`` refuses such a trace)."""
        return self.hit_blocks / self.total_blocks if self.total_blocks else math.nan

    @property
    def refs_per_s(self) -> float:
        return self.total_blocks / self.elapsed_s if self.elapsed_s > 0 else math.inf


def as_arrays(trace_or_arrays: object) -> TraceArrays:
    """TraceArrays as given (validated), from a trace path, or from a list of TraceRequest."""
    if isinstance(trace_or_arrays, TraceArrays):
        return validate_arrays(trace_or_arrays)
    if isinstance(trace_or_arrays, (str, os.PathLike)):
        return load_arrays(trace_or_arrays)
    if isinstance(trace_or_arrays, Sequence) and all(isinstance(q, TraceRequest) for q in trace_or_arrays):
        return arrays_from_requests(trace_or_arrays)
    raise TypeError("trace_or_arrays must be TraceArrays, a trace path or a sequence of TraceRequest, "
                    f"got {type(trace_or_arrays).__name__}")


def _check_options(policy: str, options: dict) -> dict:
    kernel = HITRATE_KERNELS[policy]
    unknown = sorted(set(options) - set(kernel.options))
    if unknown:
        raise TypeError(f"policy {policy!r} takes no kernel option(s) {unknown}; it takes {sorted(kernel.options)}")
    if kernel.check is not None:
        kernel.check(options)
    return {**kernel.options, **options}


def run_kernel(arrs: TraceArrays, policy: str, cap: int, hits: np.ndarray, opts: dict) -> int:
    return HITRATE_KERNELS[policy].run(arrs, cap, hits, opts)


_WARMED: set[tuple] = set()


def _warm_up(policy: str, opts: dict) -> None:
    """Compile the policy's kernel for these option types on a two-request trace, once per
    process, so ``HitRateResult.elapsed_s`` times the replay and never Numba's JIT."""
    key = (policy, tuple(sorted((k, type(v).__name__) for k, v in opts.items())))
    if key in _WARMED:
        return
    tiny = arrays_from_lists([[1, 2], [1, 3]])
    run_kernel(tiny, policy, 2, np.zeros(tiny.num_requests, dtype=np.int32), opts)
    _WARMED.add(key)


def simulate(trace_or_arrays: object, policy: str, capacity_blocks: int | None, **options) -> HitRateResult:
    """Replay a trace through ``policy`` with a cache of ``capacity_blocks`` blocks (None = unlimited)."""
    HITRATE_KERNELS.get(policy)  # TypeError for a non-str, ValueError listing the kernels for an unknown name
    if capacity_blocks is not None:
        check_int("capacity_blocks", capacity_blocks, 1)
    opts = _check_options(policy, options)
    arrs = as_arrays(trace_or_arrays)
    cap = max(1, arrs.num_unique) if capacity_blocks is None else clamp_capacity(arrs, capacity_blocks)
    hits = np.zeros(arrs.num_requests, dtype=np.int32)
    _warm_up(policy, opts)
    t0 = time.perf_counter()
    total = int(run_kernel(arrs, policy, cap, hits, opts))
    elapsed = time.perf_counter() - t0
    return HitRateResult(policy, None if capacity_blocks is None else int(capacity_blocks), total, arrs.num_refs,
                         hits, elapsed)
