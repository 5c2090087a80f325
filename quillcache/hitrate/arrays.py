"""A Mooncake-format trace as flat CSR arrays, the input of every hit-rate kernel.

``TraceArrays`` holds, for ``R`` requests and ``N`` block references:

- ``req_offsets`` int64[R+1]: request ``r`` references ``blocks[req_offsets[r]:req_offsets[r+1]]``
  (non-decreasing, ``req_offsets[0] == 0``, ``req_offsets[R] == N``);
- ``blocks`` int32[N]: block ids remapped to dense ``0..U-1`` in order of first appearance
  (so ``blocks[0] == 0`` and every id ``< U`` appears first after all smaller ids);
- ``timestamps_ms`` int64[R] (non-decreasing), ``input_tokens`` int64[R], ``output_tokens`` int64[R];
- ``next_use`` int64[N]: the position of the next reference to the same block, or
  ``N + p`` when position ``p`` is its last reference (every value is distinct, so Belady's
  "farthest next use" never ties: among dead blocks the most recently referenced goes first);
- ``conv_ids`` int32[R]: the dense id of each request's SECOND block (its first if it has only
  one, -1 if empty): a stand-in for its conversation, since the first block is often a system prompt
  shared by every conversation (on the Mooncake conversation trace every request starts with it).
- ``prefix_chained`` (bool, or None when not known: arrays built by hand): whether every block id
  has one parent, the id before it in its request (none for a request's first block), wherever it is
  referenced. That also rules out an id twice in one request (follow its two parents back to the
  request's start). Belady (with bypass) bounds every policy's prefix hits only on such traces;
  ``chain_break`` (a ``ChainBreak``, None unless ``prefix_chained`` is False) names the first
  reference that breaks it, with the trace's own ids.

Arrays are C-contiguous, own their memory and are read-only after construction
(``arrays_from_lists``). ``validate_arrays`` checks all of the above but ownership and
read-only-ness (it accepts hand-built arrays, and then re-checks them on every call) and the ids in
``chain_break`` (it checks where the break is, not the trace's ids, which the arrays no longer hold) in
O(N log N) with NumPy (the next-use check sorts; the rest is O(N)) and raises ValueError/TypeError
naming the offending value, so kernels can trust their input (an out-of-range id would otherwise
index out of bounds in nopython code).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from quillcache._checks import check_int
from quillcache.traces.loader import TraceRequest, load_trace

__all__ = [
    "ChainBreak",
    "TraceArrays",
    "arrays_from_lists",
    "arrays_from_requests",
    "clamp_capacity",
    "compute_next_use",
    "find_chain_break",
    "load_arrays",
    "unchained_message",
    "validate_arrays",
]


@dataclass(frozen=True)
class ChainBreak:
    """The first block reference (in trace order) whose parent differs from the parent the same id
    had at its first reference; ids as the trace gives them, None for "it starts its request"."""

    request: int  # 0-based index of the request
    position: int  # 0-based index of the block in that request's hash ids
    block_id: int
    parent: int | None  # the id before it here
    first_request: int  # where the id was first referenced
    first_position: int
    first_parent: int | None  # the id before it there
    in_one_request: bool  # the id occurs earlier in this same request

    def __str__(self) -> str:
        return self.describe()

    def describe(self, lines: Sequence[int] | None = None) -> str:
        """The break in words; ``lines``: the 1-based file line of each request (``lines[r]``), to name
        the lines instead of the 0-based request indices (a request beyond ``lines`` keeps its index)."""
        def after(parent: int | None) -> str:
            return "starts its request" if parent is None else f"follows id {parent}"

        if lines is None:
            twice = f"; it occurs twice in request {self.request}" if self.in_one_request else ""
            return (f"block id {self.block_id} (request {self.request}, position {self.position}) "
                    f"{after(self.parent)}, but at its first reference (request {self.first_request}, position "
                    f"{self.first_position}) it {after(self.first_parent)}{twice}")

        def line(r: int) -> str:
            return f"line {lines[r]}" if 0 <= r < len(lines) else f"request {r}"

        twice = f"; it occurs twice on {line(self.request)}" if self.in_one_request else ""
        return (f"block id {self.block_id} at hash_ids[{self.position}] {after(self.parent)}, but at its first "
                f"reference ({line(self.first_request)}, hash_ids[{self.first_position}]) it "
                f"{after(self.first_parent)}{twice}")


def unchained_message(trace: object, brk: ChainBreak, lines: Sequence[int] | None = None) -> str:
    """The one-line refusal of a trace that is not prefix-chained, ``FILE:LINE: ...`` (``lines`` as in
    ``ChainBreak.describe``; without them ``FILE: ...``): the same words in every command that refuses
    one (``hitrate``, ``replay``), each adding why it refuses."""
    where = f"{trace}:{lines[brk.request]}" if lines is not None and 0 <= brk.request < len(lines) else f"{trace}"
    return f"{where}: hash ids are not prefix-chained: {brk.describe(lines)}"


@dataclass(frozen=True, eq=False)
class TraceArrays:
    req_offsets: np.ndarray
    blocks: np.ndarray
    timestamps_ms: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    next_use: np.ndarray
    conv_ids: np.ndarray
    num_unique: int
    prefix_chained: bool | None = None  # None: not known (built by hand)
    chain_break: ChainBreak | None = None  # the first reference that breaks it (when prefix_chained is False)

    @property
    def num_requests(self) -> int:
        return int(self.req_offsets.shape[0] - 1)

    @property
    def num_refs(self) -> int:
        return int(self.blocks.shape[0])

    def request(self, r: int) -> np.ndarray:
        return self.blocks[self.req_offsets[r]:self.req_offsets[r + 1]]

    def subset(self, request_ids: np.ndarray) -> TraceArrays:
        """The sub-trace of the given requests (in the given order), ids re-densified."""
        request_ids = np.asarray(request_ids, dtype=np.int64)
        lists = [self.request(int(r)).tolist() for r in request_ids]
        return arrays_from_lists(lists, timestamps_ms=self.timestamps_ms[request_ids],
                                 input_tokens=self.input_tokens[request_ids],
                                 output_tokens=self.output_tokens[request_ids])


def compute_next_use(blocks: np.ndarray, num_unique: int) -> np.ndarray:
    """Next position of the same block, or ``N + p`` for a last reference (vectorised)."""
    n = blocks.shape[0]
    order = np.lexsort((np.arange(n), blocks))  # by block, then position
    nxt = np.empty(n, dtype=np.int64)
    if n:
        sb = blocks[order]
        same_next = np.empty(n, dtype=bool)
        same_next[:-1] = sb[1:] == sb[:-1]
        same_next[-1] = False
        nxt_sorted = np.empty(n, dtype=np.int64)
        nxt_sorted[:-1] = order[1:]
        nxt_sorted[~same_next] = n + order[~same_next]
        nxt[order] = nxt_sorted
    return nxt


def _densify(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """Remap arbitrary ids (uint64: the trace's whole [0, 2**64)) to 0..U-1 in order of first
    appearance; equal ids map to equal dense ids and different ids to different ones."""
    if raw.size == 0:
        return raw.astype(np.int32), 0
    uniq, first_idx, inverse = np.unique(raw, return_index=True, return_inverse=True)
    rank_by_first = np.empty(uniq.shape[0], dtype=np.int64)
    rank_by_first[np.argsort(first_idx, kind="stable")] = np.arange(uniq.shape[0])
    if uniq.shape[0] > np.iinfo(np.int32).max:
        raise ValueError(f"{uniq.shape[0]} distinct blocks do not fit int32 ids")
    return rank_by_first[inverse.reshape(-1)].astype(np.int32), int(uniq.shape[0])


def _first_chain_break(req_offsets: np.ndarray, blocks: np.ndarray) -> int:
    """The first position whose parent (the block before it in its request, -1 at a request's
    start) differs from the parent of the same id at its first reference, or -1 if there is none.
    ``blocks`` must be dense in order of first appearance (O(N), vectorised)."""
    n = blocks.shape[0]
    if n == 0:
        return -1
    parent = np.empty(n, dtype=np.int32)
    parent[0] = -1
    parent[1:] = blocks[:-1]
    starts = req_offsets[:-1]
    parent[starts[starts < n]] = -1  # each request's first block
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.greater(blocks[1:], np.maximum.accumulate(blocks)[:-1], out=new[1:])
    first_parent = parent[new]  # ids are dense in order of first appearance: first_parent[id]
    bad = parent != first_parent[blocks]
    p = int(np.argmax(bad))
    return p if bad[p] else -1


def _chain_break(req_offsets: np.ndarray, blocks: np.ndarray, raw: np.ndarray, p: int) -> ChainBreak:
    """The ``ChainBreak`` at position ``p`` (``_first_chain_break``), in the trace's ids ``raw``."""
    def where(q: int) -> tuple[int, int, int | None]:
        r = int(np.searchsorted(req_offsets, q, side="right")) - 1
        start = int(req_offsets[r])
        return r, q - start, None if q == start else int(raw[q - 1])

    first = int(np.argmax(blocks == blocks[p]))
    r, k, parent = where(p)
    fr, fk, fparent = where(first)
    start = int(req_offsets[r])
    return ChainBreak(r, k, int(raw[p]), parent, fr, fk, fparent, bool(np.any(blocks[start:p] == blocks[p])))


_U64 = 1 << 64


def _flat_ids(hash_lists: Sequence[Sequence[int]], n: int) -> np.ndarray:
    """uint64[n]: every request's ids in order; ValueError naming the first id outside [0, 2**64)."""
    try:
        return np.fromiter((int(x) for h in hash_lists for x in h), dtype=np.uint64, count=n)
    except OverflowError:
        for r, h in enumerate(hash_lists):
            for k, x in enumerate(h):
                v = int(x)
                if not 0 <= v < _U64:
                    why = "non-negative" if v < 0 else "below 2**64"
                    raise ValueError(f"hash ids must be {why}, got {v} (request {r}, position {k})") from None
        raise


def arrays_from_lists(hash_lists: Sequence[Sequence[int]], *, timestamps_ms: Sequence[int] | np.ndarray | None = None,
                      input_tokens: Sequence[int] | np.ndarray | None = None,
                      output_tokens: Sequence[int] | np.ndarray | None = None,
                      block_tokens: int = 512) -> TraceArrays:
    """Build arrays from per-request hash-id lists (ids in ``[0, 2**64)``, the trace schema's range;
    ValueError naming the first id outside it). Timestamps default to 0, 1, 2, ...; input tokens
    to ``len * block_tokens``; output tokens to 0. Given arrays are copied: the caller's own arrays
    are neither shared nor made read-only. ``prefix_chained`` and ``chain_break`` say whether the
    ids are prefix-chained (O(N)); a trace that is not is still converted (the caller decides)."""
    r = len(hash_lists)
    lengths = np.fromiter((len(h) for h in hash_lists), dtype=np.int64, count=r)
    offsets = np.zeros(r + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    raw = _flat_ids(hash_lists, int(offsets[-1]))
    blocks, u = _densify(raw)
    broken = _first_chain_break(offsets, blocks)
    chain_break = None if broken < 0 else _chain_break(offsets, blocks, raw, broken)
    ts = np.arange(r, dtype=np.int64) if timestamps_ms is None else np.array(timestamps_ms, dtype=np.int64, order="C")
    isl = lengths * block_tokens if input_tokens is None else np.array(input_tokens, dtype=np.int64, order="C")
    osl = np.zeros(r, dtype=np.int64) if output_tokens is None else np.array(output_tokens, dtype=np.int64, order="C")
    conv = np.full(r, -1, dtype=np.int32)
    nonempty = lengths > 0
    conv[nonempty] = blocks[(offsets[:-1] + (lengths > 1))[nonempty]]
    arrs = TraceArrays(offsets, blocks, ts, isl, osl, compute_next_use(blocks, u), conv, u, broken < 0, chain_break)
    for f in _FIELDS:
        getattr(arrs, f).setflags(write=False)
    validate_arrays(arrs)
    return arrs


def find_chain_break(hash_lists: Sequence[Sequence[int]]) -> ChainBreak | None:
    """The first reference that breaks the prefix chain of per-request hash-id lists (the rule of
    ``TraceArrays.prefix_chained``; ids as ``arrays_from_lists`` takes them), or None when they are
    prefix-chained; O(N) after the ids' densification, without building the arrays."""
    lengths = np.fromiter((len(h) for h in hash_lists), dtype=np.int64, count=len(hash_lists))
    offsets = np.zeros(len(hash_lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    raw = _flat_ids(hash_lists, int(offsets[-1]))
    blocks, _ = _densify(raw)
    broken = _first_chain_break(offsets, blocks)
    return None if broken < 0 else _chain_break(offsets, blocks, raw, broken)


def arrays_from_requests(requests: Sequence[TraceRequest], block_tokens: int = 512) -> TraceArrays:
    return arrays_from_lists([q.hash_ids for q in requests],
                             timestamps_ms=[q.timestamp_ms for q in requests],
                             input_tokens=[q.input_tokens for q in requests],
                             output_tokens=[q.output_tokens for q in requests], block_tokens=block_tokens)


def clamp_capacity(arrs: TraceArrays, capacity_blocks: int) -> int:
    """``capacity_blocks`` (an int >= 1, else TypeError/ValueError naming it) capped at the trace's
    distinct blocks (at least 1): a cache that holds every distinct block never evicts, so any
    larger capacity gives the same hits, and kernels that allocate per slot of capacity stay
    O(distinct blocks) in memory whatever the capacity asked for."""
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    return min(cap, max(1, int(arrs.num_unique)))


def load_arrays(path: str | os.PathLike | None = None, *, limit: int | None = None) -> TraceArrays:
    """Load and validate a Mooncake trace (``quillcache.traces.loader.load_trace``) into arrays."""
    return arrays_from_requests(load_trace(path, limit=limit))


def _check_array(name: str, a: object, dtype: type, ndim: int = 1) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got strides {a.strides}")
    return a


def _frozen(a: object) -> bool:
    """A numpy array that nothing else can write through: read-only and owning its memory."""
    return isinstance(a, np.ndarray) and not a.flags.writeable and a.flags.owndata


_VALIDATED: weakref.WeakSet[TraceArrays] = weakref.WeakSet()
_FIELDS = ("req_offsets", "blocks", "timestamps_ms", "input_tokens", "output_tokens", "next_use", "conv_ids")


def _check_chain(arrs: TraceArrays, off: np.ndarray, blocks: np.ndarray) -> None:
    """``prefix_chained`` is None or says what the blocks say; ``chain_break`` is a ``ChainBreak``
    at the first break exactly when ``prefix_chained`` is False."""
    chained, brk = arrs.prefix_chained, arrs.chain_break
    if chained is not None and not isinstance(chained, (bool, np.bool_)):
        raise TypeError(f"prefix_chained must be a bool or None, got {chained!r}")
    if (brk is not None) != (chained is not None and not chained):
        raise ValueError(f"chain_break must be given exactly when prefix_chained is False; got prefix_chained="
                         f"{chained!r}, chain_break={brk!r}")
    if chained is None:
        return
    p = _first_chain_break(off, blocks)
    if bool(chained) != (p < 0):
        raise ValueError(f"prefix_chained={bool(chained)} but the blocks are "
                         + ("prefix-chained" if p < 0 else f"not (block reference {p} breaks it)"))
    if brk is not None and (not isinstance(brk, ChainBreak) or not 0 <= brk.request < off.shape[0] - 1
                            or int(off[brk.request]) + brk.position != p):
        raise ValueError(f"chain_break {brk!r} is not the first break, block reference {p}")


def validate_arrays(arrs: object) -> TraceArrays:
    """Check every invariant in the module docstring; return ``arrs`` or raise naming the value.

    An instance that passed once and whose arrays are all still read-only and own their memory is
    not re-checked (the O(N log N) next-use check would otherwise dominate short replays). A
    read-only view can change through the writable memory under it, so an instance holding any
    view, or any writable array, is checked again on every call."""
    if not isinstance(arrs, TraceArrays):
        raise TypeError(f"expected TraceArrays, got {type(arrs).__name__}")
    if arrs in _VALIDATED and all(_frozen(getattr(arrs, f)) for f in _FIELDS):
        return arrs
    off = _check_array("req_offsets", arrs.req_offsets, np.int64)
    blocks = _check_array("blocks", arrs.blocks, np.int32)
    nu = _check_array("next_use", arrs.next_use, np.int64)
    if off.shape[0] < 1:
        raise ValueError("req_offsets must hold at least one entry (0)")
    r = off.shape[0] - 1
    n = blocks.shape[0]
    if off[0] != 0 or off[-1] != n:
        raise ValueError(f"req_offsets must start at 0 and end at len(blocks)={n}, got {int(off[0])}..{int(off[-1])}")
    lengths = np.diff(off)
    if r and np.any(lengths < 0):
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"req_offsets must be non-decreasing; req_offsets[{i + 1}]={int(off[i + 1])} < {int(off[i])}")
    for name in ("timestamps_ms", "input_tokens", "output_tokens"):
        a = _check_array(name, getattr(arrs, name), np.int64)
        if a.shape[0] != r:
            raise ValueError(f"{name} has {a.shape[0]} entries for {r} requests")
    ts = arrs.timestamps_ms
    if r > 1 and np.any(ts[1:] < ts[:-1]):
        i = int(np.argmax(ts[1:] < ts[:-1]))
        raise ValueError(f"timestamps_ms must be non-decreasing; "
                         f"timestamps_ms[{i + 1}]={int(ts[i + 1])} < {int(ts[i])}")
    conv = _check_array("conv_ids", arrs.conv_ids, np.int32)
    if conv.shape[0] != r:
        raise ValueError(f"conv_ids has {conv.shape[0]} entries for {r} requests")
    u = arrs.num_unique
    check_int("num_unique", u, 0, type_error=ValueError)
    if n:
        lo, hi = int(blocks.min()), int(blocks.max())
        if lo < 0 or hi >= u:
            raise ValueError(f"block ids must lie in [0, num_unique={u}), got range [{lo}, {hi}]")
        # dense in order of first appearance: the running maximum starts at 0 and grows by at most 1
        # per reference (each step up is the first reference of that id) up to U - 1
        top = np.maximum.accumulate(blocks)
        jump = top[1:] - top[:-1] > 1
        why = "dense 0..num_unique-1 in order of first appearance"
        if blocks[0] != 0:
            raise ValueError(f"block ids must be {why}; blocks[0]={int(blocks[0])} is not 0")
        if np.any(jump):
            p = int(np.argmax(jump)) + 1
            raise ValueError(f"block ids must be {why}; "
                             f"blocks[{p}]={int(blocks[p])} appears before id {int(top[p - 1]) + 1}")
        if int(top[-1]) != u - 1:
            raise ValueError(f"block ids must be {why}; num_unique={u} but only ids 0..{int(top[-1])} appear")
    elif u:
        raise ValueError(f"num_unique={u} but there are no block references")
    if r:
        want = np.full(r, -1, np.int32)
        has = lengths > 0
        want[has] = blocks[(off[:-1] + (lengths > 1))[has]]
        if not np.array_equal(conv, want):
            i = int(np.argmax(conv != want))
            raise ValueError(f"conv_ids[{i}]={int(conv[i])} must be request {i}'s second block id "
                             f"(its first if it has one block, -1 if none): {int(want[i])}")
    if nu.shape[0] != n:
        raise ValueError(f"next_use has {nu.shape[0]} entries for {n} block references")
    if n and not np.array_equal(nu, compute_next_use(blocks, u)):
        raise ValueError("next_use does not match blocks (recompute it with compute_next_use)")
    _check_chain(arrs, off, blocks)
    _VALIDATED.add(arrs)
    return arrs
