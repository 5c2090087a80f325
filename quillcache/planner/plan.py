"""Plan and action types: what the control plane decided for one request.

A :class:`Plan` names the prefill worker, the decode worker, and one :class:`BlockAction` per full
prompt block: the reused prefix (``LOCAL_HIT`` on the worker's GPU, ``FETCH_DRAM``/``FETCH_SSD``
from its own tiers, ``FETCH_PEER`` from another node) followed by ``RECOMPUTE`` for the rest; the
blocks written while decoding are ``DECODE`` (on the decode worker). The reused prefix is contiguous
from block 0 (engines resume prefill after a cached prefix).

Invariants: ``actions[:reused_blocks]`` are reuse actions and ``actions[reused_blocks:]`` are all
``RECOMPUTE``; every reused block names the located replica row it comes from
(``source_rows``), and that replica passed the identity guard when the guard was on. What a
response may carry (``disclosure()``, ``usage()``) depends only on the request's own scope and
public blocks (see :mod:`quillcache.identity.scope`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from quillcache._checks import check_int
from quillcache.identity.scope import RequestScope
from quillcache.index.base import LocateResult
from quillcache.index.keys import ResidencyEntry
from quillcache.planner.cost_model import SOURCE_NAMES
from quillcache.types import CacheTier

__all__ = ["MAX_INPUT_TOKENS", "BlockAction", "Plan", "PlanRequest", "TimingClass"]

# The longest prompt a plan takes: the trace schema's limit on ``input_length`` (below 2**31). The
# planner kernels compute ``isl * (isl - 1)`` in int64 (the attention term of the prefill cost), which
# stays exact below 2**62 at this bound and would wrap above about 3.04e9 tokens.
MAX_INPUT_TOKENS = (1 << 31) - 1


class BlockAction(enum.IntEnum):
    LOCAL_HIT = 0
    FETCH_DRAM = 1
    FETCH_SSD = 2
    FETCH_PEER = 3
    RECOMPUTE = 4
    DECODE = 5


# source kind (cost_model.SOURCE_NAMES) -> action
KIND_ACTION = np.array(
    [BlockAction.LOCAL_HIT, BlockAction.FETCH_DRAM, BlockAction.FETCH_SSD, BlockAction.FETCH_PEER,
     BlockAction.FETCH_PEER, BlockAction.FETCH_PEER, BlockAction.FETCH_PEER],
    dtype=np.int8,
)
assert len(KIND_ACTION) == len(SOURCE_NAMES)


class TimingClass(enum.Enum):
    """The latency class a plan promises (a response may carry it)."""

    WITHIN_SLO = "within-slo"
    OVER_SLO = "over-slo"


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """One request to plan: its identity scope, its full blocks' hashes and its lengths.

    ``tokens``: the prompt's token ids (1-D uint32, ``input_tokens`` of them) or None. Recording
    needs them to write registered public blocks under the public scope (the tokens must BE the
    registered prompt's, :meth:`RequestScope.write_digests`); without them every block is recorded
    under the request's own scope. ``Planner.request`` always sets them.

    ``input_tokens`` is an integer in ``[1, MAX_INPUT_TOKENS]`` (2**31 - 1, so the kernels' int64
    cost sums cannot wrap; the plain-Python reference takes the same requests); anything else is
    refused with an error naming the field.
    """

    scope: RequestScope
    block_hashes: np.ndarray  # uint64, one per FULL prompt block, contiguous
    input_tokens: int
    output_tokens: int = 0
    tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scope, RequestScope):
            raise TypeError(f"scope must be a RequestScope (IdentityRegistry.scope), got {type(self.scope).__name__}")
        h = self.block_hashes
        if not isinstance(h, np.ndarray) or h.dtype != np.uint64 or h.ndim != 1:
            raise TypeError(f"block_hashes must be a 1-D uint64 array, got {getattr(h, 'dtype', type(h).__name__)}")
        if not h.flags.c_contiguous:
            raise ValueError("block_hashes must be contiguous (np.ascontiguousarray)")
        check_int("input_tokens", self.input_tokens, 1, MAX_INPUT_TOKENS)  # an empty prompt is refused
        check_int("output_tokens", self.output_tokens, 0)
        t = self.tokens
        if t is not None:
            if not isinstance(t, np.ndarray) or t.dtype != np.uint32 or t.ndim != 1:
                raise TypeError(f"tokens must be None or a 1-D uint32 array, got {getattr(t, 'dtype', type(t).__name__)}")
            if len(t) != self.input_tokens:
                raise ValueError(f"tokens has {len(t)} ids but input_tokens={self.input_tokens}")
        bs = self.scope.identity.layout.block_size_tokens
        if len(h) != self.input_tokens // bs:
            raise ValueError(
                f"{len(h)} block hashes for {self.input_tokens} tokens at {bs} tokens/block; "
                f"expected {self.input_tokens // bs} (full blocks only)"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(slots=True, eq=False)
class Plan:
    """The control plane's decision for one request (see module doc)."""

    request: PlanRequest
    worker: str
    worker_index: int
    decode_worker: str
    decode_worker_index: int
    actions: np.ndarray  # int8 BlockAction per full prompt block
    source_kinds: np.ndarray  # int8 source kind per block (-1: recompute)
    source_rows: np.ndarray  # int32 row of `located` each reused block comes from (-1: recompute)
    reused_blocks: int
    fetch_bytes: int
    fetch_s: float
    new_prefill_tokens: int
    decode_blocks: int  # blocks the request holds while decoding
    predicted_ttft_s: float
    ttft_slo_s: float
    guard: bool
    located: LocateResult | None
    _node_name: Callable[[int], str] | None
    _entries: list[ResidencyEntry] | None = None  # set by the reference planner (per-block objects)

    @property
    def block_size_tokens(self) -> int:
        return self.request.scope.identity.layout.block_size_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from cache (own scope or registered public blocks only)."""
        return self.reused_blocks * self.block_size_tokens

    @property
    def meets_slo(self) -> bool:
        return self.predicted_ttft_s <= self.ttft_slo_s

    @property
    def timing_class(self) -> TimingClass:
        return TimingClass.WITHIN_SLO if self.meets_slo else TimingClass.OVER_SLO

    @property
    def num_decode_blocks(self) -> int:
        """Blocks written while decoding (the partial last prompt block included)."""
        bs = self.block_size_tokens
        r = self.request
        return -(-(r.input_tokens + r.output_tokens) // bs) - r.input_tokens // bs if r.output_tokens else 0

    def block_actions(self) -> list[BlockAction]:
        """Every block of the sequence: prompt blocks, then ``DECODE`` blocks."""
        return [BlockAction(int(a)) for a in self.actions] + [BlockAction.DECODE] * self.num_decode_blocks

    def reused_entries(self) -> list[ResidencyEntry]:
        """The located replica each reused block comes from (for audits and transfers)."""
        if self._entries is not None:
            return list(self._entries)
        assert self.located is not None and self._node_name is not None
        out = []
        keys, values = self.located.keys, self.located.values
        for j in range(self.reused_blocks):
            r = int(self.source_rows[j])
            k, v = keys[r], values[r]
            out.append(ResidencyEntry(
                int(k["block_hash"]), self._node_name(int(k["node_no"])), CacheTier(int(k["tier"])),
                bytes(k["identity"]), int(v["segment_id"]), int(v["offset_bytes"]), int(v["size_bytes"]),
            ))
        return out

    def usage(self) -> dict[str, int]:
        """OpenAI-style usage fields this plan allows a response to carry."""
        return {"prompt_tokens": self.request.input_tokens, "cached_tokens": self.cached_tokens}

    def disclosure(self) -> dict[str, str]:
        """The ``x-quillcache-*`` headers a response may carry (own-scope facts only)."""
        return {
            "x-quillcache-worker": self.worker,
            "x-quillcache-decode-worker": self.decode_worker,
            "x-quillcache-cached-tokens": str(self.cached_tokens),
            "x-quillcache-timing-class": self.timing_class.value,
        }
