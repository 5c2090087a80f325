"""A learned next-use policy in the spirit of LRB (Song et al., "Learning Relaxed Belady for
Content Distribution Network Caching", NSDI '20), small enough to run per reference in Numba.

Belady evicts the key whose next use is farthest; LRB learns to *predict* that distance from
features of the key's past and evicts, among a random sample of cached keys, the one predicted
to come back last. Here:

- **Features** (captured at each reference of a key, all from the past): a bias, the block's
  position in its request's prefix chain, the request's length in blocks, the last two gaps
  between references of the key, its reference count (each as ``bit_length / 16``, a log2 scale
  computed exactly with integers), whether it is the request's partial last block, and whether it
  was a prefix hit. Without request hints (``begin_request`` not called) position and length are
  0 and "hit" means touched.
- **Model**: online linear regression of ``log2`` of the gap to the next reference
  (``bit_length(gap)``), trained by one SGD step (``learning_rate``) each time a label becomes
  known: at the key's next reference (label: that gap), or once it has gone ``window_mult x
  capacity`` references without one (label: ``bit_length(2 x window)``: LRB's memory window).
  Training uses only the past: a label is the gap that has already happened.
- **Prediction**: at each reference ``next = now + 2**pred`` (``2**x`` as
  ``ldexp(1 + frac(x), floor(x))``, exact in any language).
- **Eviction**: ``sample_size`` cached keys drawn uniformly with replacement (SplitMix64 over a
  counter seeded by ``seed`` mod 2**64; the cached keys sit in a swap-remove array); the victim has the
  largest ``max(predicted next - now, age)``: a key past its predicted return is treated as
  coming back no sooner than its age again. Ties: the first drawn. Keys the predicate refuses are
  skipped; if every draw is refused, the first evictable key of the array.

Age enters the decision (not the model), as LRB's per-sample "time since last access" would;
one linear model instead of LRB's GBDT keeps it above 1M references/s (the gradient-boosted
model costs far more per reference). Defaults: LRB's sample size (64); window 8x capacity; the
learning rate keeps the SGD step ``lr * |x|^2`` well below 2 for features <= ~1.3 (stable).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from quillcache._checks import check_float, check_int
from quillcache._mix import MASK64, splitmix64
from quillcache.policies.base import MAX_BLOCK_TOKENS, EvictionPolicy, Key, Predicate, always

NUM_FEATURES = 8
FEATURE_SCALE = 16.0
MAX_LOG_GAP = 40.0


def exp2_exact(x: float) -> float:
    """``2**x`` as ``ldexp(1 + frac(x), floor(x))``: piecewise linear in the fraction, exact."""
    f = math.floor(x)
    return math.ldexp(1.0 + (x - f), int(f))


class LrbPolicy(EvictionPolicy):
    name = "lrb"

    def __init__(self, *, capacity_keys: int | None = None, sample_size: int = 64, window_mult: int = 8,
                 learning_rate: float = 0.02, seed: int = 0, block_tokens: int = 512) -> None:
        super().__init__()
        self.capacity_keys = None if capacity_keys is None else check_int("capacity_keys", capacity_keys, 1)
        self.sample_size = check_int("sample_size", sample_size, 1, 4096)
        self.window_mult = check_int("window_mult", window_mult, 1, 1 << 20)
        self.learning_rate = check_float("learning_rate", learning_rate, 0.0, 1.0, lo_open=True)
        self.seed = check_int("seed", seed, 0)
        self.block_tokens = check_int("block_tokens", block_tokens, 1, MAX_BLOCK_TOKENS)
        self.w = [0.0] * NUM_FEATURES
        self._t = 0
        self._ctr = self.seed & MASK64
        self._last: dict[Key, int] = {}
        self._feats: dict[Key, list[float]] = {}
        self._next: dict[Key, float] = {}
        self._labeled: dict[Key, bool] = {}
        self._refs: dict[Key, int] = {}
        self._gap1: dict[Key, int] = {}
        self._gap2: dict[Key, int] = {}
        self._history: deque[tuple[int, Key]] = deque()
        self._slots: list[Key] = []
        self._slot_of: dict[Key, int] = {}
        self._peak = 0
        self._req: Sequence[Key] | None = None
        self._req_pos = 0
        self._req_hits = 0
        self._req_partial = False

    def _window(self) -> int:
        cap = self.capacity_keys if self.capacity_keys is not None else max(self._peak, 1)
        return self.window_mult * cap

    def predicted_next(self, key: Key) -> float:
        self._require(key)
        return self._next[key]

    def begin_request(self, keys: Sequence[Key], num_hit: int, input_tokens: int | None = None) -> None:
        check_int("num_hit", num_hit, 0, len(keys))
        self._req, self._req_pos, self._req_hits = keys, 0, num_hit
        self._req_partial = input_tokens is not None and input_tokens % self.block_tokens != 0

    # ---- the model ------------------------------------------------------------------------
    def _train(self, x: list[float], y: float) -> None:
        w = self.w
        pred = 0.0
        for i in range(NUM_FEATURES):
            pred += w[i] * x[i]
        err = y - pred
        step = self.learning_rate * err
        for i in range(NUM_FEATURES):
            w[i] += step * x[i]

    def _reference(self, key: Key, touched: bool) -> None:
        self._t += 1
        t = self._t
        window = self._window()
        hist = self._history
        y_expired = float((2 * window).bit_length())
        while hist and t - hist[0][0] > window:
            t0, x = hist.popleft()
            if self._last.get(x) == t0 and not self._labeled[x]:
                self._train(self._feats[x], y_expired)
                self._labeled[x] = True
        lt = self._last.get(key)
        if lt is not None:
            gap = t - lt
            if not self._labeled[key]:
                self._train(self._feats[key], float(gap.bit_length()))
            self._gap2[key] = self._gap1.get(key, 0)
            self._gap1[key] = gap
        refs = self._refs.get(key, 0) + 1
        self._refs[key] = refs
        req = self._req
        j, n, partial, hit = 0, 0, 0.0, 1.0 if touched else 0.0
        if req is not None and self._req_pos < len(req) and req[self._req_pos] == key:
            j = self._req_pos
            self._req_pos += 1
            n = len(req)
            partial = 1.0 if (j == n - 1 and self._req_partial) else 0.0
            hit = 1.0 if j < self._req_hits else 0.0
        s = FEATURE_SCALE
        x = [1.0, (j + 1).bit_length() / s, n.bit_length() / s, self._gap1.get(key, 0).bit_length() / s,
             self._gap2.get(key, 0).bit_length() / s, refs.bit_length() / s, partial, hit]
        pred = 0.0
        for i in range(NUM_FEATURES):
            pred += self.w[i] * x[i]
        pred = min(max(pred, 0.0), MAX_LOG_GAP)
        self._next[key] = t + exp2_exact(pred)
        self._feats[key] = x
        self._labeled[key] = False
        self._last[key] = t
        hist.append((t, key))

    # ---- protocol -------------------------------------------------------------------------
    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._peak = max(self._peak, len(self._sizes))
        self._slot_of[key] = len(self._slots)
        self._slots.append(key)
        self._reference(key, touched=False)

    def touch(self, key: Key) -> None:
        self._require(key)
        self._reference(key, touched=True)

    def _unslot(self, key: Key) -> None:
        i = self._slot_of.pop(key)
        last = self._slots.pop()
        if last != key:
            self._slots[i] = last
            self._slot_of[last] = i

    def remove(self, key: Key) -> None:
        self._drop(key)
        self._unslot(key)
        for d in (self._last, self._feats, self._next, self._labeled, self._refs, self._gap1, self._gap2):
            d.pop(key, None)

    def evict(self, key: Key) -> None:
        self._drop(key)
        self._unslot(key)

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        slots = self._slots
        if not slots:
            return None
        now = self._t + 1
        best, best_s = None, 0.0
        n = len(slots)
        for _ in range(self.sample_size):
            z = splitmix64(self._ctr)
            self._ctr = (self._ctr + 1) & MASK64
            key = slots[z % n]
            if not is_evictable(key):
                continue
            score = max(self._next[key] - now, float(now - self._last[key]))
            if best is None or score > best_s:
                best, best_s = key, score
        if best is None:
            best = next((k for k in slots if is_evictable(k)), None)
        return best
