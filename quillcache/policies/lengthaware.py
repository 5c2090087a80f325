"""Length-aware LFU: our reading of Mooncake's ``LengthAwareCache``.

Source: Qin et al., "Mooncake: Trading More Storage for Less Computation - A KVCache-centric
Architecture for Serving LLM Chatbot", FAST'25, section 4.2 / Table 1, which describes it only as
"similar to LFU but prioritizing cache blocks occurring later in requests"; no code is published.
We read "prioritizing" as eviction priority: among blocks of equal frequency, the one that sits
later in its request (deeper in the prefix chain) is evicted first, because a later block is
useless once an earlier one is gone while the reverse does not hold. (The opposite reading,
evicting earlier blocks first, orphans whole chains and fell far below LFU on the conversation
trace, so we do not take it; ``docs/hitrate_tuning_log.md``.)

Order: evict the minimum of ``(frequency, -depth, last access seq)`` where
- frequency is 1 at insert and +1 per touch, forgotten when the key leaves (in-cache LFU);
- depth is the key's 0-based position in the request that referenced it last, given by the
  replay harness through ``begin_request(keys, num_hit, input_tokens)`` (keys referenced outside
  an announced request get depth 0, so without hints this is exactly LFU with LRU tie-break);
- seq is a counter bumped on every insert/touch (least recent first among equals).

Structure: a binary heap of ``(frequency, -depth, seq, key)`` entries with lazy deletion (an
entry is live while it equals the key's current triple); ``victim`` pops stale tops, so it
reorganizes only the heap, never membership. O(log n) amortized per call.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class LengthAwarePolicy(EvictionPolicy):
    name = "lengthaware"

    def __init__(self) -> None:
        super().__init__()
        self._prio: dict[Key, tuple[int, int, int]] = {}
        self._heap: list[tuple[int, int, int, int, Key]] = []
        self._seq = 0
        self._req: Sequence[Key] | None = None
        self._req_pos = 0

    def begin_request(self, keys: Sequence[Key], num_hit: int = 0, input_tokens: int | None = None) -> None:
        """Announce the keys of the next request, in order (only their positions are used)."""
        self._req = keys
        self._req_pos = 0

    def _depth(self, key: Key) -> int:
        req = self._req
        if req is not None and self._req_pos < len(req) and req[self._req_pos] == key:
            self._req_pos += 1
            return self._req_pos - 1
        return 0

    def _set(self, key: Key, freq: int) -> None:
        self._seq += 1
        prio = (freq, -self._depth(key), self._seq)
        self._prio[key] = prio
        heapq.heappush(self._heap, (*prio, 0, key))
        if len(self._heap) > 2 * len(self._prio) + 16:
            self._heap = [(*p, 0, k) for k, p in self._prio.items()]  # seq is unique: keys never compared
            heapq.heapify(self._heap)

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._set(key, 1)

    def touch(self, key: Key) -> None:
        self._require(key)
        self._set(key, self._prio[key][0] + 1)

    def remove(self, key: Key) -> None:
        self._drop(key)
        del self._prio[key]

    def frequency(self, key: Key) -> int:
        self._require(key)
        return self._prio[key][0]

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        heap = self._heap
        while heap and self._prio.get(heap[0][4]) != heap[0][:3]:
            heapq.heappop(heap)
        if heap and is_evictable(heap[0][4]):
            return heap[0][4]
        live = sorted((p, k) for k, p in self._prio.items() if is_evictable(k)) if heap else []
        return live[0][1] if live else None
