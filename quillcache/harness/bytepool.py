"""``BytePool``: the replay's seam where a block's bytes leave a GPU for a host tier (offload), leave
a node (drop) and are read by another node (peer fetch).

The replay (:mod:`quillcache.harness.replay`) decides every placement, hit and time with the real
data planes, planner and engine model; at each of the three points above it also tells its
``BytePool``, in the order they happened, one batch per replay event (an arrival, a prefill's end):

- ``offload(blocks)``: these blocks' KV just entered a host tier (DRAM) of ``block.node``;
- ``drop(blocks)``: these blocks' bytes just left ``block.node``'s host tiers (DRAM and SSD);
- ``fetch(blocks)``: a request reused these blocks from ANOTHER node's DRAM/SSD (source kinds 4/5 of
  ``CostModel.SOURCE_NAMES``); GPU-to-GPU fetches (kind 3) hold no host bytes and never reach a pool.

Invariant: a pool object is one (node, block) pair, so after every batch the set of objects a pool
holds equals the set of (node, block) pairs with host bytes in the data planes (a mirror). A fetch
of a pair the pool does not hold (a miss), or of bytes other than the ones offloaded (corrupt),
therefore means the pool lost or damaged data; both are counted and both must stay 0. The pool
never changes the replay's decisions: the summary of a replay is the same whatever its pool.

Implementations:
- :class:`AccountingPool` (the default): today's accounting, nothing moved. It counts blocks and
  reports the engine model's transfer time for them at the model's block size.
- :class:`quillcache.harness.cluster_pool.ClusterPool`: real bytes through ``PooledStore`` to node
  processes, each block a deterministic pseudo-random payload (:func:`block_payload`) verified on
  every fetch, measured beside the engine model's prediction for the same bytes.

Predictions (``PoolReport.predicted_*_s``) use the engine model's own formula,
``CostModel.fetch_s(kinds, block_bytes)``: a fetch batch of one request at its source kinds; an
offload batch as blocks written to a peer's DRAM (kind 4: the same link, written instead of read).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol, runtime_checkable

import numpy as np

from quillcache.planner.cost_model import CostModel
from quillcache.store.keys import StoreKey

__all__ = ["AccountingPool", "BytePool", "PoolBlock", "PoolReport", "block_payload", "pool_key",
           "PEER_DRAM_KIND", "PEER_SSD_KIND"]

PEER_DRAM_KIND, PEER_SSD_KIND = 4, 5  # CostModel.SOURCE_NAMES: "peer-dram", "peer-ssd"


@dataclass(frozen=True, slots=True)
class PoolBlock:
    """One block at one of the seam's points: the node whose host tiers hold (or held) its bytes,
    the block's size in the replay's model (``tier_block_bytes``) and, for a fetch, its source kind."""

    key: StoreKey
    node: str
    model_bytes: int
    kind: int = PEER_DRAM_KIND


def pool_key(block: PoolBlock) -> str:
    """The pool object's name of a (node, block) pair: ``<node>/<hash>-<identity>`` (a master key)."""
    return f"{block.node}/{block.key.hex()}"


def block_payload(name: str, size_bytes: int) -> bytes:
    """``size_bytes`` deterministic pseudo-random bytes for the object ``name`` (PCG64 seeded by the
    BLAKE2b digest of the name): the same name always gives the same bytes, two names differ."""
    if size_bytes < 0:
        raise ValueError(f"size_bytes={size_bytes} must be >= 0")
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=16).digest(), "little")
    return np.random.Generator(np.random.PCG64(seed)).bytes(size_bytes)


@dataclass(kw_only=True)
class PoolReport:
    """What a pool did during one replay. ``real_bytes`` False: nothing moved, the byte counts are the
    model's bytes and the measured times are NaN. Counters must satisfy ``misses == corrupt == 0``."""

    pool: str
    real_bytes: bool
    nodes: int = 0
    block_bytes: int = 0  # payload bytes of one block in the pool (the model's size when not real)
    replicas: int = 0
    blocks_offloaded: int = 0
    blocks_dropped: int = 0
    blocks_fetched: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    offload_failures: int = 0  # puts the pool refused (no space, a node lost): later fetches miss
    drop_failures: int = 0  # removes the pool refused (e.g. a read lease still held): the object stays
    misses: int = 0
    corrupt: int = 0
    fallbacks: int = 0  # gets served by a second replica
    measured_offload_s: float = math.nan
    measured_fetch_s: float = math.nan
    measured_transfer_s: float = math.nan  # the transfer engine's own time (PooledStore.stats)
    predicted_offload_s: float = 0.0
    predicted_fetch_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def measured_s(self) -> float:
        return self.measured_offload_s + self.measured_fetch_s

    @property
    def predicted_s(self) -> float:
        return self.predicted_offload_s + self.predicted_fetch_s

    def as_dict(self) -> dict[str, object]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d["measured_s"], d["predicted_s"] = self.measured_s, self.predicted_s
        return {**d, **self.extra}

    def copy(self) -> PoolReport:
        return PoolReport(**{**asdict(self), "extra": dict(self.extra)})


@runtime_checkable
class BytePool(Protocol):
    """The replay's byte seam (module docstring). Batches arrive in event order; a method must not
    raise for a block it cannot move (count it: ``offload_failures``, ``misses``...)."""

    def offload(self, blocks: Sequence[PoolBlock]) -> None: ...

    def drop(self, blocks: Sequence[PoolBlock]) -> None: ...

    def fetch(self, blocks: Sequence[PoolBlock]) -> int:
        """Returns how many of ``blocks`` were found with the right bytes."""
        ...

    def report(self) -> PoolReport: ...

    def close(self) -> None: ...


class _Predictor:
    """The engine model's time for moving blocks of ``block_bytes`` (module docstring)."""

    def __init__(self, cost_model: CostModel | None, block_bytes: int) -> None:
        self.cm = cost_model
        self.block_bytes = block_bytes

    def offload_s(self, n: int) -> float:
        return self.cm.fetch_s([PEER_DRAM_KIND] * n, self.block_bytes) if (self.cm and n) else 0.0

    def fetch_s(self, kinds: list[int]) -> float:
        return self.cm.fetch_s(kinds, self.block_bytes) if (self.cm and kinds) else 0.0


class AccountingPool:
    """The embedded default: moves nothing (the replay's byte counters are the accounting) and counts
    the blocks at each point, with the engine model's time for them at the model's block size
    (``bind`` gives it the cost model and block size; unbound, predictions are 0)."""

    name = "accounting"

    def __init__(self) -> None:
        self._r = PoolReport(pool=self.name, real_bytes=False)
        self._p = _Predictor(None, 0)

    def bind(self, cost_model: CostModel, model_block_bytes: int) -> None:
        self._p = _Predictor(cost_model, model_block_bytes)
        self._r.block_bytes = model_block_bytes

    def offload(self, blocks: Sequence[PoolBlock]) -> None:
        r = self._r
        r.blocks_offloaded += len(blocks)
        r.bytes_written += sum(b.model_bytes for b in blocks)
        r.predicted_offload_s += self._p.offload_s(len(blocks))

    def drop(self, blocks: Sequence[PoolBlock]) -> None:
        self._r.blocks_dropped += len(blocks)

    def fetch(self, blocks: Sequence[PoolBlock]) -> int:
        r = self._r
        r.blocks_fetched += len(blocks)
        r.bytes_read += sum(b.model_bytes for b in blocks)
        r.predicted_fetch_s += self._p.fetch_s([b.kind for b in blocks])
        return len(blocks)

    def report(self) -> PoolReport:
        return self._r.copy()

    def close(self) -> None:
        pass
