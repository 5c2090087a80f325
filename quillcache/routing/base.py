"""Workers, live load tracking and the router interface.

A router picks one worker for a request from per-worker columns (numpy arrays indexed by worker
number): the request's consecutive cached-prefix overlap on each worker by tier, and the live
load every worker carries right now. Load is live: a request's load is counted by
:meth:`LoadTracker.acquire` BEFORE the upstream call and released after it (``with
tracker.track(...)`` or ``lease.release()``), so the next decision already sees it - without this
every request with the same hot prefix would dog-pile the one cache-hot worker.

Invariants:
- Load counters are never negative: a lease releases exactly what it acquired, once (a second
  ``release`` is a no-op), under the tracker's lock.
- ``Router.select`` only ever returns the index of an eligible worker; with no eligible worker it
  raises ``ValueError``.
- Randomness (tie-breaks, temperature sampling) comes from the router's own seeded
  ``random.Random``, so a seed reproduces every decision.
"""

from __future__ import annotations

import abc
import enum
import random
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from quillcache._checks import check_int
from quillcache.index.keys import MAX_NODE_NAME_BYTES, node_name_key

__all__ = [
    "MAX_LEASE_LOAD",
    "MAX_ROUTE_LOAD",
    "MAX_ROUTE_TOKENS",
    "EngineRole",
    "Lease",
    "LoadTracker",
    "RouteRequest",
    "Router",
    "WorkerSpec",
    "pick_min",
]


MAX_LEASE_LOAD = 1 << 40  # per lease, prefill tokens or decode blocks: far beyond any real request
MAX_ROUTE_TOKENS = 1 << 40  # isl_tokens and block_size_tokens of a route: keeps the kernels' int64 math exact
MAX_ROUTE_LOAD = 1 << 52  # active_prefill_tokens and decode_blocks of a worker: exact in float64, no int64 wrap
_I64_MAX = (1 << 63) - 1


class EngineRole(enum.Enum):
    """What an engine does: prefill only, decode only, or both (aggregated serving)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def prefills(self) -> bool:
        return self is not EngineRole.DECODE

    @property
    def decodes(self) -> bool:
        return self is not EngineRole.PREFILL


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """An engine worker; ``name`` is its node name in the residency index, so it follows the
    index's node-name rule (:func:`quillcache.index.keys.node_name_key`): 1 to 200 UTF-8 bytes,
    no NUL. A name the index would refuse is refused here, before any plan is made."""

    name: str
    role: EngineRole = EngineRole.BOTH

    def __post_init__(self) -> None:
        try:
            node_name_key(self.name)
        except ValueError:  # IndexKeyError, or UnicodeEncodeError for a lone surrogate
            raise ValueError(f"worker name must be 1..{MAX_NODE_NAME_BYTES} UTF-8 bytes without NUL (an index "
                             f"node name), got {self.name!r:.80}") from None
        if not isinstance(self.role, EngineRole):
            raise TypeError(f"role must be an EngineRole, got {self.role!r}")


def as_worker_specs(workers: Sequence[WorkerSpec | str]) -> tuple[WorkerSpec, ...]:
    if isinstance(workers, (str, bytes)) or not isinstance(workers, Sequence):
        raise TypeError(f"workers must be a sequence of WorkerSpec or names, got {type(workers).__name__}")
    specs = tuple(w if isinstance(w, WorkerSpec) else WorkerSpec(name=w) for w in workers)
    if not specs:
        raise ValueError("at least one worker is needed")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate worker names {dup}")
    return specs


class Lease:
    """The load one request puts on its workers, from acquire until release."""

    __slots__ = ("_live", "_prefilling", "_tracker", "decode_blocks", "decode_worker_index", "prefill_tokens", "worker_index")

    def __init__(self, tracker: LoadTracker, worker_index: int, decode_worker_index: int,
                 prefill_tokens: int, decode_blocks: int) -> None:
        self._tracker = tracker
        self.worker_index = worker_index
        self.decode_worker_index = decode_worker_index
        self.prefill_tokens = prefill_tokens
        self.decode_blocks = decode_blocks
        self._prefilling = True
        self._live = True

    @property
    def live(self) -> bool:
        return self._live

    def prefill_done(self) -> None:
        """The first token is out: its prefill tokens stop counting (decode blocks stay)."""
        t = self._tracker
        with t._lock:
            if self._live and self._prefilling:
                t._prefill[self.worker_index] -= self.prefill_tokens
                self._prefilling = False

    def release(self) -> None:
        """The request finished (or failed): release everything it still holds. Idempotent."""
        t = self._tracker
        with t._lock:
            if not self._live:
                return
            if self._prefilling:
                t._prefill[self.worker_index] -= self.prefill_tokens
                self._prefilling = False
            t._decode[self.decode_worker_index] -= self.decode_blocks
            t._inflight[self.worker_index] -= 1
            if self.decode_worker_index != self.worker_index:
                t._inflight[self.decode_worker_index] -= 1
            self._live = False
            assert t._prefill.min(initial=0) >= 0 and t._decode.min(initial=0) >= 0

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LoadTracker:
    """Live per-worker load: in-flight prefill tokens, active decode blocks, in-flight requests."""

    def __init__(self, workers: Sequence[WorkerSpec | str]) -> None:
        self.workers = as_worker_specs(workers)
        self.names = tuple(w.name for w in self.workers)
        self.index_of = {n: i for i, n in enumerate(self.names)}
        n = len(self.workers)
        self._prefill = np.zeros(n, dtype=np.int64)
        self._decode = np.zeros(n, dtype=np.int64)
        self._inflight = np.zeros(n, dtype=np.int64)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.workers)

    # Read-only views for routers: reading without the lock sees each counter atomically enough
    # for a heuristic (a decision made a microsecond earlier would have seen the same race).
    @property
    def active_prefill_tokens(self) -> np.ndarray:
        v = self._prefill.view()
        v.flags.writeable = False
        return v

    @property
    def decode_blocks(self) -> np.ndarray:
        v = self._decode.view()
        v.flags.writeable = False
        return v

    @property
    def inflight(self) -> np.ndarray:
        v = self._inflight.view()
        v.flags.writeable = False
        return v

    def _index(self, worker: int | str) -> int:
        if isinstance(worker, str):
            i = self.index_of.get(worker)
            if i is None:
                raise ValueError(f"unknown worker {worker!r}; known: {list(self.names)}")
            return i
        return check_int("worker index", worker, 0, len(self.names) - 1, type_error=ValueError)

    def acquire(self, worker: int | str, *, prefill_tokens: int, decode_blocks: int,
                decode_worker: int | str | None = None) -> Lease:
        """Count a request's load now (before the upstream call); release it with the lease.

        ``prefill_tokens`` and ``decode_blocks`` must be integers in ``[0, MAX_LEASE_LOAD]`` and
        the counters they add to must stay within int64; otherwise ``ValueError`` naming the
        argument, and no counter has changed."""
        w = self._index(worker)
        d = w if decode_worker is None else self._index(decode_worker)
        prefill_tokens = check_int("prefill_tokens", prefill_tokens, 0, MAX_LEASE_LOAD, type_error=ValueError)
        decode_blocks = check_int("decode_blocks", decode_blocks, 0, MAX_LEASE_LOAD, type_error=ValueError)
        with self._lock:
            # every new value is computed and checked before any counter changes: a refused
            # acquire leaves the tracker exactly as it was
            p = int(self._prefill[w]) + prefill_tokens
            db = int(self._decode[d]) + decode_blocks
            if p > _I64_MAX:
                raise ValueError(f"prefill_tokens={prefill_tokens} would overflow worker {self.names[w]!r}'s "
                                 f"active prefill tokens ({int(self._prefill[w])} already)")
            if db > _I64_MAX:
                raise ValueError(f"decode_blocks={decode_blocks} would overflow worker {self.names[d]!r}'s "
                                 f"decode blocks ({int(self._decode[d])} already)")
            self._prefill[w] = p
            self._decode[d] = db
            self._inflight[w] += 1
            if d != w:
                self._inflight[d] += 1
        return Lease(self, w, d, prefill_tokens, decode_blocks)

    @contextmanager
    def track(self, worker: int | str, *, prefill_tokens: int, decode_blocks: int,
              decode_worker: int | str | None = None) -> Iterator[Lease]:
        """``with tracker.track(w, ...) as lease:`` - load counted for the body, released after."""
        lease = self.acquire(worker, prefill_tokens=prefill_tokens, decode_blocks=decode_blocks,
                             decode_worker=decode_worker)
        try:
            yield lease
        finally:
            lease.release()

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                n: {"active_prefill_tokens": int(p), "decode_blocks": int(d), "inflight": int(f)}
                for n, p, d, f in zip(self.names, self._prefill, self._decode, self._inflight)
            }


@dataclass(slots=True)
class RouteRequest:
    """What a router sees of one request, as per-worker columns.

    ``overlaps``: int64 (3, n_workers): consecutive leading blocks of the request each worker holds
    on its GPU (row 0), then in host DRAM beyond the device prefix (row 1), then on disk beyond
    the host prefix (row 2). ``eligible``: bool mask of workers that may take the request (None =
    all). Loads are the live counters of a :class:`LoadTracker`.
    """

    overlaps: np.ndarray
    isl_tokens: int
    block_size_tokens: int
    active_prefill_tokens: np.ndarray
    decode_blocks: np.ndarray
    eligible: np.ndarray | None = None

    @property
    def num_workers(self) -> int:
        return int(self.overlaps.shape[1])


def _check_column(name: str, a: np.ndarray, kinds: str) -> None:
    """``a``'s dtype kind is in ``kinds``, in native byte order (floats: float32 or float64, the
    dtypes the compiled kernels take), and every value is finite and >= 0."""
    if a.dtype.kind not in kinds:
        want = "an integer" if kinds == "iu" else "an integer or float"
        raise ValueError(f"{name} must have {want} dtype, got dtype {a.dtype}")
    if not a.dtype.isnative:
        raise ValueError(f"{name} must be in native byte order, got dtype {a.dtype.str!r}")
    if a.dtype.kind == "f" and a.dtype.itemsize not in (4, 8):
        raise ValueError(f"{name} must be float32 or float64 if float, got dtype {a.dtype}")
    if a.size == 0:
        return
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {a.tolist()!r:.120}")
    if a.dtype.kind != "u" and a.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {a.tolist()!r:.120}")


def check_route(route: RouteRequest) -> None:
    """Validate a route request (shapes, dtypes, values, sizes); routers call it before deciding.

    ``overlaps``: an integer array of shape (3, n >= 1), values >= 0, each worker's three counts
    summing to at most the request's ``ceil(isl_tokens / block_size_tokens)`` blocks (a prefix
    overlap cannot be longer than the prompt). ``active_prefill_tokens`` and ``decode_blocks``:
    integer or float arrays of shape (n,), finite, >= 0 and at most ``MAX_ROUTE_LOAD`` (2**52: exact in
    float64, and a load plus a prompt's tokens cannot wrap int64 in the compiled kernels). Every column is in
    native byte order and a float column is float32 or float64 (the compiled kernels take no other; float16
    could not hold the loads either). ``eligible``: None or a bool array of
    shape (n,). ``isl_tokens`` and ``block_size_tokens`` are integers in ``[1, MAX_ROUTE_TOKENS]``
    (2**40), so ``overlap * block_size`` and every sum of the cost kernels stay far inside int64
    and the compiled kernels compute what their plain-Python references do. Anything else raises
    ``ValueError`` (``TypeError`` for a non-RouteRequest) naming the field."""
    if not isinstance(route, RouteRequest):
        raise TypeError(f"route must be a RouteRequest, got {type(route).__name__}")
    ov = route.overlaps
    if not isinstance(ov, np.ndarray) or ov.ndim != 2 or ov.shape[0] != 3 or ov.shape[1] < 1:
        raise ValueError(f"overlaps must be an int array of shape (3, n_workers >= 1), got {getattr(ov, 'shape', ov)}")
    _check_column("overlaps", ov, "iu")
    n = ov.shape[1]
    for name in ("active_prefill_tokens", "decode_blocks"):
        a = getattr(route, name)
        if not isinstance(a, np.ndarray) or a.shape != (n,):
            raise ValueError(f"{name} must be an array of shape ({n},), got {getattr(a, 'shape', a)}")
        _check_column(name, a, "iuf")
        if a.size and a.max() > MAX_ROUTE_LOAD:
            raise ValueError(f"{name} must be at most {MAX_ROUTE_LOAD} (2**52), got {a.max().item()!r:.40}")
    if route.eligible is not None and (
        not isinstance(route.eligible, np.ndarray) or route.eligible.shape != (n,) or route.eligible.dtype != np.bool_
    ):
        raise ValueError(f"eligible must be a bool array of shape ({n},) or None")
    isl = check_int("isl_tokens", route.isl_tokens, type_error=ValueError)
    if isl < 1:
        raise ValueError(f"isl_tokens={route.isl_tokens!r}; an empty prompt cannot be routed")
    check_int("isl_tokens", isl, 1, MAX_ROUTE_TOKENS)
    bs = check_int("block_size_tokens", route.block_size_tokens, 1, MAX_ROUTE_TOKENS, type_error=ValueError)
    blocks = -(-isl // bs)
    # each count first (a sum of huge int64 counts would wrap), then the per-worker sums
    if int(ov.max()) > blocks or int(ov.sum(axis=0).max()) > blocks:
        w = int(np.argmax(ov.sum(axis=0, dtype=np.float64)))  # a worker over the limit (float: cannot wrap)
        raise ValueError(f"overlaps of worker {w} are {ov[:, w].tolist()} blocks (device, host, disk), more in all "
                         f"than the request's ceil(isl_tokens / block_size_tokens) = {blocks} blocks")


def pick_min(values: np.ndarray, eligible: np.ndarray | None, rng: random.Random) -> int:
    """Index of the smallest eligible value, ties broken uniformly at random."""
    if eligible is not None:
        if not eligible.any():
            raise ValueError("no eligible worker for this request")
        values = np.where(eligible, values, np.inf)
    m = values.min()
    ties = np.flatnonzero(values == m)
    if len(ties) == 1:
        return int(ties[0])
    return int(ties[int(rng.random() * len(ties))])


class Router(abc.ABC):
    """Picks a worker. Registered by name in ``quillcache.routing.ROUTERS``."""

    name: str = "abstract"

    def __init__(self, *, seed: int | None = None) -> None:
        if seed is not None:  # >= 0, as PlannerConfig's: Random(-1) draws what Random(1) draws
            seed = check_int("seed", seed, 0)
        self.rng = random.Random(seed)

    def select(self, route: RouteRequest) -> int:
        """Index of the chosen worker (an eligible one); validates ``route`` first."""
        check_route(route)
        return self._select(route)

    @abc.abstractmethod
    def _select(self, route: RouteRequest) -> int:
        """``select`` without validation (the planner's hot path builds valid routes)."""

    def clone(self, seed: int | None = None) -> Router:
        """A router of the same kind and options with its own generator (seeded with ``seed``)."""
        return type(self)(seed=seed)

    def logits(self, route: RouteRequest) -> np.ndarray:
        """Per-worker cost (lower is better) where the router has one."""
        raise NotImplementedError(f"router {self.name!r} has no cost logits")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
