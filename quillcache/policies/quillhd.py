"""QuillHD: learned hit density per prefix class, with a tail-first-LRU safety net (ours).

Longer than 600 lines because it is the plain-Python specification of its Numba kernel
(``quillcache.hitrate.kernels.quillhd``): the learned densities, the classifications, both rules,
admission, the shadows and the second chance act on the same per-key state in one order, and the
kernel is checked against this class as a whole.

Why: in a prefix KV cache a block is reused when its conversation (or shared prompt) comes back,
after a think time that has a floor (tens of seconds) and a long tail, and with a probability that
grows with the number of turns seen so far. LRU cannot tell a block that will come back from one
that will not; Belady can. QuillHD learns, online and per class, how likely and how soon blocks
come back, and evicts the block with the lowest expected hits per unit of cache space-time
(hit density, Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI'18).

Classes (8), from prefix structure only (no trace constants):
- 0: a request's partial last block (``input_tokens % block_tokens != 0``): engines never reuse
  it as a prefix (the next turn fills it with more tokens, giving it a new hash);
- 1..4: a block that was NOT a prefix hit in this request, referenced 1, 2, 3, >=4 times so far;
- 5..7: a prefix-hit block referenced 2, 3, >=4 times so far.
Without request hints (``begin_request`` not called, e.g. inside a data-plane tier) a block is
"hit" when it is touched and "new" when inserted, and class 0 is never used.

Learning (independent of what is cached, so small caches still learn long reuse times):
- every reference ends the previous "lifetime" of its key: if that began at most ``horizon``
  references ago, a hit at that age is counted for the class the key had then (ghost accounting:
  counted whether or not the key was still cached); a lifetime not renewed within ``horizon`` is
  counted as an eviction at age ``horizon``. Ages are bucketed quasi-logarithmically (exact below
  16, 8 buckets per octave).
- every ``period`` references: for each class and age bucket a,
  ``HD[c][a] = sum_{x>=a} H[c][x] / sum_{x>=a} (x - a) * (H[c][x] + E[c][x])`` (LHD's estimator
  over bucket midpoints), then all histograms are multiplied by ``decay`` (EWMA).
- the horizon adapts every period: ``max(che_mult * capacity / insertion rate, the
  quantile-th age of all observed reuse times)`` - the LRU characteristic time of this cache
  (Che's approximation) or the age that covers most reuses, whichever is longer.

Eviction: each class keeps its keys in LRU order; the HD rule compares the head (oldest) of each
class list and evicts the one with the lowest density (ties: the older). The tail-first-LRU rule
evicts class-0 keys first, then the globally least recent key (the oldest class-list head).
In ``mode="adaptive"`` (default) two metadata-only shadow caches of the same capacity run the two
rules on the same stream; every period the real cache switches to the rule whose shadow had more
prefix hits (decayed by ``decay``). Shadows and learning state cost O(1) per reference.

Defaults (``period=4096`` references, ``decay=0.9``, ``quantile=0.95``, ``che_mult=1``) come
from a small sweep of quantile and che_mult on the Mooncake conversation trace: the smallest
caches were insensitive to them and the largest were not, which is why the adaptive shadow rule
exists. They are the same for every capacity and were not re-tuned on the synthetic trace of
``experiments/hitrate_study.py`` (the sweep's figures: ``docs/hitrate_tuning_log.md``).

Relatives on the same machinery (options of this class, fixed by the subclasses): ``classes``
picks the classification - ``"prefix"`` (above, the default), ``"reuse"`` (LHD's: first reference,
then log-spaced reuse distance; ``quillcache.policies.lhd``) or ``"chain"`` (18 classes: turns
seen on the request's chain, reference counts of prefix hits, first sight, partial tails;
``quillcache.policies.quillchain``); ``leaf_first`` re-queues a hinted request's cached blocks
deepest first once it ends (real cache only); ``admit`` refuses, under the HD rule and with the
cache full, a new key worth less than its victim (its class's density at age 0 against the
victim's worth at the victim's age; and, in a hinted request, every later new key of it), in the
real cache and in any shadow running the HD rule; ``shared_rate`` (chain classes only) values a
key that hinted requests forked from (branched off where no request ended) with at least
``RATE_MIN_REFS`` references at no less than its own rate while in use, discounted by its
silence (``_value``), on both sides of admission (``_incoming_value``: a shared prompt coming back
after an eviction is worth its rate, not the density of the class a block missing from a
request's prefix falls into; see ``quillcache.policies.quillchain``); ``second_chance`` (chain
classes only) makes the LRU rule skip, once, a victim that was touched while cached with at least
two references and a fork (a shared prefix used again while cached): it is unmarked and re-queued
at the tail of its class (``_choose_evicting``, at most ``second_chance_max(block_tokens)`` per
eviction: the same span of prompt tokens whatever the block size); ``cap_period`` makes a period
last at most the capacity in blocks (``learning_period``; without a known capacity, the largest
occupancy so far), so learned densities remember a few cache lifetimes;
``mode="challenger"`` replaces the two shadows by one that runs the rule the real cache does not,
the two swapping rules when the shadow had more decayed prefix hits over a period; and
``start_rule`` is the rule the real cache starts on in the modes that switch rules (``"hd"``, the
default, or ``"lru"``; in challenger mode the shadow starts on the other), kept until a period's
comparison of prefix hits says otherwise.

Memory: reference metadata (last time, class, count) is kept for every key ever seen, like a
ghost list of unbounded length (about 24 bytes per key in a compiled version); ``remove`` forgets
a key entirely.

Exactness: ``quillcache.hitrate.kernels.quillhd`` is the compiled twin of this class driven by the
reference replay harness; the two agree hit for hit (same float operations in the same order).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence

from quillcache._checks import check_choice, check_float, check_int
from quillcache.policies.base import MAX_BLOCK_TOKENS, EvictionPolicy, Key, Predicate, always

NUM_CLASSES = 8
HD_SUB = 8
NUM_BUCKETS = 320
RULE_LRU, RULE_HD = 0, 1
SECOND_CHANCE_TOKENS = 64 * 512  # the LRU rule with second_chance: at most this many prompt tokens' worth per eviction
MODES = ("adaptive", "hd", "lru", "challenger")
START_RULES = ("hd", "lru")  # the rule the real cache starts on (adaptive and challenger modes)
CLASSES = ("prefix", "reuse", "chain")  # QuillHD's, LHD's (quillcache.policies.lhd), QuillChain's
CHAIN_CLASSES = 18  # chain classes: partial tail, 5 prefix-hit reference-count classes, 6 turn classes x 2
RATE_MIN_REFS = 4  # shared-prefix rate: a forked-from block with at least this many references ...
RATE_SILENCE_GAPS = 4.0  # ... is worth its own rate, discounted by exp(-silence / (this many mean gaps))


PERIOD_MIN_REFS = 512  # cap_period: a learning period is at least this many references
# the longest ``period``: a period this long never ends in any trace (10**15 references), and every
# sum of it with a reference count fits the hit-rate kernel's int64 (larger values: ValueError)
MAX_PERIOD_REFS = 1 << 50


def learning_period(period: int, capacity: int) -> int:
    """The length in references of the next learning / challenger period with ``cap_period``:
    ``period``, but at most the cache's capacity in blocks (and at least ``PERIOD_MIN_REFS``, which
    bounds the share of each reference spent on the O(classes x age buckets) update). Densities
    decay by ``decay`` every period, so their memory is a few cache lifetimes instead of a fixed
    number of references, which is mostly stale history for a small cache."""
    return min(check_int("period", period, 1), max(PERIOD_MIN_REFS, check_int("capacity", capacity, 1)))


def second_chance_max(block_tokens: int) -> int:
    """The most second chances per eviction with ``block_tokens``-token blocks:
    ``SECOND_CHANCE_TOKENS // block_tokens`` (at least 1). The bound is a span of prompt tokens, not
    a number of blocks, so that a shared prompt gets the same protection whatever the engine's block
    size: 64 at 512-token blocks (where it was chosen), 2,048 at 16-token blocks."""
    return max(1, SECOND_CHANCE_TOKENS // check_int("block_tokens", block_tokens, 1))


def reuse_class(gap: int) -> int:
    """LHD's class of a reference: 0 = first reference, 1 = a gap below 128, then one class per
    factor of 4 of the gap (at most 7)."""
    if gap <= 0:
        return 0
    return min(7, 1 + max(0, gap.bit_length() - 6) // 2)


def turn_class(turns: int) -> int:
    """The class of a request's blocks from the turns seen on its chain (1..6)."""
    if turns < 3:
        return 1 + turns
    if turns < 5:
        return 4
    if turns < 9:
        return 5
    return 6


def ref_class(refs: int) -> int:
    """The class offset of a prefix-hit block by its references so far (>= 2): 2, 3, 4-7, 8-15,
    >= 16 (0..4)."""
    if refs <= 2:
        return 0
    if refs == 3:
        return 1
    if refs < 8:
        return 2
    if refs < 16:
        return 3
    return 4


def chain_class(j: int, k: int, refs: int, tcls: int) -> int:
    """QuillChain's class of a full block at position ``j`` of a request with ``k`` prefix hits:
    1..5 a prefix hit seen before (by ``ref_class``), else 6 + 2 * (turn class - 1) + (seen
    before), 6..17."""
    if j < k and refs >= 2:
        return 1 + ref_class(refs)
    return 6 + 2 * (tcls - 1) + (1 if refs >= 2 else 0)


def age_bucket(a: int) -> int:
    """Exact below 16, then ``HD_SUB`` buckets per octave (a quasi-logarithmic age scale)."""
    if a < 16:
        return a
    e = a.bit_length() - 4
    return 16 + (e - 1) * HD_SUB + ((a >> e) - 8)


def bucket_mid(i: int) -> float:
    if i < 16:
        return float(i)
    e = (i - 16) // HD_SUB + 1
    m = (i - 16) % HD_SUB
    return float((8 + m) << e) + float(1 << e) * 0.5


_MIDS = [bucket_mid(i) for i in range(NUM_BUCKETS)]


def _clamp(i: int) -> int:
    return i if i < NUM_BUCKETS else NUM_BUCKETS - 1


class _Instance:
    """One cache's membership: per-class key lists in LRU order (real cache or a shadow)."""

    __slots__ = ("cls", "lists", "marked")

    def __init__(self, num_classes: int) -> None:
        self.lists: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(num_classes)]
        self.cls: dict[Key, int] = {}
        self.marked: set[Key] = set()  # second_chance earned

    def __len__(self) -> int:
        return len(self.cls)

    def place(self, key: Key, c: int) -> None:
        old = self.cls.get(key)
        if old is not None:
            del self.lists[old][key]
        self.lists[c][key] = None
        self.cls[key] = c

    def drop(self, key: Key) -> None:
        c = self.cls.pop(key)
        del self.lists[c][key]
        self.marked.discard(key)


class QuillHdPolicy(EvictionPolicy):
    name = "quillhd"

    def __init__(self, *, capacity_keys: int | None = None, mode: str = "adaptive", period: int = 4096,
                 decay: float = 0.9, quantile: float = 0.95, che_mult: float = 1.0, block_tokens: int = 512,
                 classes: str = "prefix", leaf_first: bool = False, admit: bool = False,
                 shared_rate: bool = False, second_chance: bool = False, cap_period: bool = False,
                 start_rule: str = "hd") -> None:
        super().__init__()
        check_choice("mode", mode, MODES)
        check_choice("start_rule", start_rule, START_RULES)
        check_choice("classes", classes, CLASSES)
        for flag, value in (("leaf_first", leaf_first), ("admit", admit), ("shared_rate", shared_rate),
                            ("second_chance", second_chance), ("cap_period", cap_period)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be bool, got {value!r}")
        if shared_rate and classes != "chain":
            raise ValueError(f"shared_rate needs classes='chain' (it counts forks where chains end), got {classes!r}")
        if second_chance and classes != "chain":
            raise ValueError(f"second_chance needs classes='chain' (it counts forks where chains end), got {classes!r}")
        self.shared_rate = shared_rate
        self.second_chance = second_chance
        self.classes = classes
        self.leaf_first = leaf_first
        self.admit_by_density = admit
        self.num_classes = ncls = CHAIN_CLASSES if classes == "chain" else NUM_CLASSES
        if capacity_keys is not None:
            capacity_keys = check_int("capacity_keys", capacity_keys, 1)
        period = check_int("period", period, 1, MAX_PERIOD_REFS)
        block_tokens = check_int("block_tokens", block_tokens, 1, MAX_BLOCK_TOKENS)
        check_float("decay", decay, 0.0, 1.0, lo_open=True)
        check_float("quantile", quantile, 0.0, 1.0, lo_open=True)
        check_float("che_mult", che_mult, 0.0, 1e6)
        self.capacity_keys = capacity_keys
        self.mode = mode
        self.period = period  # references; with cap_period the most a period lasts (``learning_period``)
        self.cap_period = cap_period
        self.decay = float(decay)
        self.quantile = float(quantile)
        self.che_mult = float(che_mult)
        self.block_tokens = block_tokens
        self._second_max = second_chance_max(block_tokens)
        self._real = _Instance(ncls)
        self._shadows = ((_Instance(ncls), _Instance(ncls)) if mode == "adaptive" else (_Instance(ncls),)
                         if mode == "challenger" else ())
        # per instance (real, shadows): an uncached block of the current request was refused, so
        # are its later uncached blocks (``admit``; they could not be prefix hits without it)
        self._bypass = [False, False, False]
        # decayed prefix hits: adaptive: of the LRU shadow, the HD shadow; challenger: of the real
        # cache, its one shadow (which runs ``_shadow_rule``, the rule the real cache does not)
        self._score = [0.0, 0.0]
        self.start_rule = start_rule
        starts_lru = mode == "lru" or (start_rule == "lru" and mode in ("adaptive", "challenger"))
        self._rule = RULE_LRU if starts_lru else RULE_HD
        self._shadow_rule = RULE_HD if starts_lru else RULE_LRU  # challenger: the rule the real cache does not run
        self._last: dict[Key, int] = {}
        self._lastc: dict[Key, int] = {}
        self._refs: dict[Key, int] = {}
        self._first: dict[Key, int] = {}  # time of the first reference
        self._fork: dict[Key, int] = {}  # shared_rate: requests that branched off a known prefix through the key
        self._expired: set[Key] = set()
        self._history: deque[tuple[int, Key]] = deque()
        self._hh = [[0.0] * NUM_BUCKETS for _ in range(ncls)]
        self._ee = [[0.0] * NUM_BUCKETS for _ in range(ncls)]
        self._hd = [[0.0] * NUM_BUCKETS for _ in range(ncls)]
        self._rd = [0.0] * NUM_BUCKETS
        self._t = 0
        self._n_ins = 0
        self._peak = 0
        self._plen = self._period_len()  # the length of the period in progress
        self._next_upd = self._plen
        self._horizon: int | None = None  # 2 * capacity until the first update
        # request hints
        self._req: Sequence[Key] | None = None
        self._req_pos = 0
        self._req_hits = 0
        self._req_partial = False
        self._req_turn_class = 1
        self._req_closed = True
        self._ends: dict[Key, int] = {}  # chain classes: requests whose last full block was the key

    # ---- introspection --------------------------------------------------------------------
    @property
    def rule(self) -> str:
        return "hd" if self._rule == RULE_HD else "lru"

    @property
    def horizon(self) -> int:
        return self._horizon if self._horizon is not None else 2 * self._capacity()

    def class_of(self, key: Key) -> int:
        self._require(key)
        return self._real.cls[key]

    def hit_density(self, cls: int, age: int) -> float:
        return self._hd[cls][_clamp(age_bucket(age))]

    def _period_len(self) -> int:
        return learning_period(self.period, self._capacity()) if self.cap_period else self.period

    def _capacity(self) -> int:
        return self.capacity_keys if self.capacity_keys is not None else max(self._peak, 1)

    # ---- request hints --------------------------------------------------------------------
    def begin_request(self, keys: Sequence[Key], num_hit: int, input_tokens: int | None = None) -> None:
        """Announce a request: its keys in order, how many leading keys were prefix hits, and its
        input length in tokens (for partial-block detection). The following insert/touch calls
        that follow ``keys`` in order are classified with this context."""
        check_int("num_hit", num_hit, 0, len(keys))
        self._req = keys
        self._req_pos = 0
        self._req_hits = num_hit
        self._req_partial = input_tokens is not None and input_tokens % self.block_tokens != 0
        self._req_closed = False
        self._bypass = [False, False, False]
        if self.classes == "chain":
            turns = m = 0
            for key in keys:
                if key not in self._last:
                    break
                turns += min(self._ends.get(key, 0), 1)
                m += 1
            self._req_turn_class = turn_class(turns)
            # a fork: the known prefix ends inside the request where no earlier request ended (a
            # new branch of a shared prefix, not the next turn of a conversation)
            counts_forks = self.shared_rate or self.second_chance
            if counts_forks and 0 < m < len(keys) and self._ends.get(keys[m - 1], 0) == 0:
                for key in keys[:m]:
                    self._fork[key] = self._fork.get(key, 0) + 1
        if self.mode == "challenger":
            self._score[0] += num_hit
        for i, shadow in enumerate(self._shadows):
            n = 0
            for key in keys:
                if key in shadow.cls:
                    n += 1
                else:
                    break
            self._score[i + (self.mode == "challenger")] += n

    # ---- the learning step ----------------------------------------------------------------
    def _classify(self, key: Key, touched: bool, gap: int) -> int:
        """The class of this reference (``_refs`` already counts it); advances the request cursor."""
        c = self._class_of_ref(key, touched, gap, self._refs[key])
        req = self._req
        if req is not None and self._req_pos < len(req) and req[self._req_pos] == key:
            self._req_pos += 1
        return c

    def _class_of_ref(self, key: Key, touched: bool, gap: int, refs: int) -> int:
        """The class a reference to ``key`` gets now, its ``refs``-th (no state changes)."""
        req = self._req
        n = min(4, refs)
        if self.classes == "reuse":
            return reuse_class(gap)
        if req is not None and self._req_pos < len(req) and req[self._req_pos] == key:
            j = self._req_pos
            if j == len(req) - 1 and self._req_partial:
                return 0
            if self.classes == "chain":
                return chain_class(j, self._req_hits, refs, self._req_turn_class)
            return n if j >= self._req_hits else 3 + n
        if self.classes == "chain":  # unhinted: a touch counts as a prefix hit, turn class 1
            return chain_class(0, 1 if touched else 0, refs, 1)
        return 3 + max(n, 2) if touched else n

    def _observe(self, key: Key, touched: bool) -> tuple[int, int | None]:
        """Advance time, learn from this reference; returns (new class, old class or None)."""
        self._t += 1
        t = self._t
        horizon = self.horizon
        hb = _clamp(age_bucket(horizon))
        hist = self._history
        while hist and t - hist[0][0] > horizon:
            t0, x = hist.popleft()
            if self._last.get(x) == t0 and x not in self._expired:
                self._ee[self._lastc[x]][hb] += 1.0
                self._expired.add(x)
        lt = self._last.get(key)
        gap = t - lt if lt is not None else 0
        if lt is not None:
            bi = _clamp(age_bucket(t - lt))
            self._rd[bi] += 1.0
            if key not in self._expired:
                self._hh[self._lastc[key]][bi] += 1.0
        self._expired.discard(key)
        self._refs[key] = refs = self._refs.get(key, 0) + 1
        if refs == 1 and self.shared_rate:
            self._first[key] = t
        c = self._classify(key, touched, gap)
        return c, self._lastc.get(key)

    def _refuses(self, inst: _Instance, rule: int, c: int, key: Key, refs: int, victim: Key, t: int) -> bool:
        """``admit``: under the HD rule, ``key`` (class ``c``, ``refs`` references with this one)
        is worth less at time ``t`` (``_incoming_value``) than ``victim`` at its age."""
        if not self.admit_by_density or rule != RULE_HD:
            return False
        return self._incoming_value(c, key, refs, t) < self._value(inst.cls[victim], victim, t)

    def _incoming_value(self, c: int, key: Key, refs: int, t: int) -> float:
        """A key's worth as it is referenced at time ``t`` (``refs`` counts this reference): its
        class's hit density at age 0 or, under the conditions of ``_value``, its own rate
        ``(refs - 1) / (t - first)``, whichever is higher (``_value`` at age 0)."""
        val = self._hd[c][0]
        if self._rated(key, refs):
            r = self._own_rate(key, refs, t)
            if r > val:
                val = r
        return val

    def _rated(self, key: Key, refs: int) -> bool:
        """``shared_rate`` on and ``key`` forked from with at least ``RATE_MIN_REFS`` references."""
        return self.shared_rate and refs >= RATE_MIN_REFS and self._fork.get(key, 0) >= 1

    def _own_rate(self, key: Key, refs: int, upto: int) -> float:
        """``(refs - 1) / (upto - first)``: references per unit time since the first one."""
        return (refs - 1) / max(upto - self._first[key], 1)

    def _value(self, c: int, key: Key, t: int) -> float:
        """A cached key's worth at time ``t``: its class's hit density at its age or, with
        ``shared_rate`` and a key that requests forked from with at least ``RATE_MIN_REFS``
        references, its own rate while in use ``r = (refs - 1) / (last - first)`` discounted by
        ``exp(-age * r / RATE_SILENCE_GAPS)``, whichever is higher."""
        last = self._last[key]
        val = self._hd[c][_clamp(age_bucket(t - last))]
        refs = self._refs[key]
        if self._rated(key, refs):
            r = self._own_rate(key, refs, last)
            rate = r * math.exp(-((t - last) * r) / RATE_SILENCE_GAPS)
            if rate > val:
                val = rate
        return val

    def _shadow_access(self, key: Key, c: int) -> None:
        cap = self._capacity()
        challenger = self.mode == "challenger"
        for i, shadow in enumerate(self._shadows):
            rule = self._shadow_rule if challenger else RULE_LRU if i == 0 else RULE_HD
            if key not in shadow.cls:
                if self._bypass[i + 1]:
                    continue
                if len(shadow) >= cap:
                    v = self._choose_evicting(shadow, rule, always, self._t)
                    assert v is not None
                    if self._refuses(shadow, rule, c, key, self._refs[key], v, self._t):
                        self._bypass[i + 1] = self._req is not None
                        continue
                    shadow.drop(v)
            else:
                if self._req is None:  # unhinted: score per-reference hits instead of prefix hits
                    self._score[i + challenger] += 1
                self._mark(shadow, key)
            shadow.place(key, c)

    def _finish(self, key: Key, c: int) -> None:
        self._last[key] = self._t
        self._lastc[key] = c
        self._history.append((self._t, key))
        if self._t >= self._next_upd:
            self._update()
            self._plen = self._period_len()
            self._next_upd += self._plen
        req = self._req
        if req is not None and not self._req_closed and self._req_pos == len(req):
            self._close_request(req)

    def _close_request(self, req: Sequence[Key]) -> None:
        """After a hinted request's last key: count where its chain ended (chain classes) and,
        with ``leaf_first``, re-queue its blocks in the real cache deepest first (ancestors end
        most recent)."""
        self._req_closed = True
        if self.classes == "chain":
            lf = len(req) - 2 if self._req_partial else len(req) - 1
            if lf >= 0:
                self._ends[req[lf]] = self._ends.get(req[lf], 0) + 1
        if self.leaf_first:  # the real cache only: the shadows compare the two rules, not the order
            real = self._real
            for key in reversed(req):
                c = real.cls.get(key)
                if c is not None:
                    real.lists[c].move_to_end(key)

    def _update(self) -> None:
        cap = self._capacity()
        che = self.che_mult * cap * self._plen / max(self._n_ins, 1)
        self._n_ins = 0
        qa = self._quantile_age()
        self._horizon = int(max(che, qa, 1.0))
        decay = self.decay
        for c in range(self.num_classes):
            hh, ee, hd = self._hh[c], self._ee[c], self._hd[c]
            sh = st = sx = 0.0
            for i in range(NUM_BUCKETS - 1, -1, -1):
                tot = hh[i] + ee[i]
                sh += hh[i]
                st += tot
                sx += tot * _MIDS[i]
                life = sx - _MIDS[i] * st
                hd[i] = sh / life if life > 0.0 else 0.0
            for i in range(NUM_BUCKETS):
                hh[i] *= decay
                ee[i] *= decay
        rd = self._rd
        for i in range(NUM_BUCKETS):
            rd[i] *= decay
        if self.mode == "challenger":
            if self._score[1] > self._score[0]:
                self._rule, self._shadow_rule = self._shadow_rule, self._rule
                self._score = [0.0, 0.0]
            else:
                self._score[0] *= decay
                self._score[1] *= decay
        elif self._shadows:
            self._rule = RULE_HD if self._score[1] >= self._score[0] else RULE_LRU
            self._score[0] *= decay
            self._score[1] *= decay

    def _quantile_age(self) -> int:
        tot = 0.0
        for v in self._rd:
            tot += v
        if tot <= 0.0:
            return 0
        acc = 0.0
        for i, v in enumerate(self._rd):
            acc += v
            if acc >= self.quantile * tot:
                return int(_MIDS[i])
        return int(_MIDS[-1])

    # ---- victim choice ----------------------------------------------------------------------
    def _choose(self, inst: _Instance, rule: int, is_evictable: Predicate, t: int) -> Key | None:
        """The victim under ``rule`` among ``inst``'s keys, ages measured at time ``t``."""
        firsts: list[Key | None] = []
        for lst in inst.lists:
            first = None
            for key in lst:
                if is_evictable(key):
                    first = key
                    break
            firsts.append(first)
        if rule == RULE_LRU:
            if firsts[0] is not None:
                return firsts[0]
            best = None
            for key in firsts[1:]:
                if key is not None and (best is None or self._last[key] < self._last[best]):
                    best = key
            return best
        best, best_v, best_a = None, 0.0, 0
        for c, key in enumerate(firsts):
            if key is None:
                continue
            a = t - self._last[key]
            val = self._value(c, key, t)
            if best is None or val < best_v or (val == best_v and a > best_a):
                best, best_v, best_a = key, val, a
        return best

    def _mark(self, inst: _Instance, key: Key) -> None:
        """``second_chance``: ``key`` (cached in ``inst``, being touched; its references already
        counted) earns a second chance if it has at least two references and a fork."""
        if self.second_chance and self._refs[key] >= 2 and self._fork.get(key, 0) >= 1:
            inst.marked.add(key)

    def _choose_evicting(self, inst: _Instance, rule: int, is_evictable: Predicate, t: int) -> Key | None:
        """``_choose`` for an eviction about to happen: under the LRU rule with ``second_chance``, a
        marked victim is unmarked and re-queued at the tail of its class, and the victim chosen
        again, at most ``second_chance_max(block_tokens)`` times."""
        v = self._choose(inst, rule, is_evictable, t)
        if self.second_chance and rule == RULE_LRU:
            for _ in range(self._second_max):
                if v is None or v not in inst.marked:
                    break
                inst.marked.discard(v)
                inst.lists[inst.cls[v]].move_to_end(v)
                v = self._choose(inst, rule, is_evictable, t)
        return v

    # ---- protocol -------------------------------------------------------------------------
    def admit(self, key: Key, size_bytes: int) -> bool:
        """Always True unless ``admit``: then, with the cache at ``capacity_keys`` and the HD rule
        in force, a key worth less than the victim it would displace (``victim()`` with no keys
        refused by a predicate) is refused, and, within a hinted request, every later new key of
        it. A refused key is still a reference: it is learned from, the shadows see it, and it is
        remembered like an evicted key. Call it once per attempt to store a key."""
        super().admit(key, size_bytes)
        if key in self._sizes or not self.admit_by_density:
            return True
        refused = self._bypass[0]
        if not refused and self.capacity_keys is not None and len(self._sizes) >= self.capacity_keys:
            t = self._t + 1
            lt = self._last.get(key)
            refs = self._refs.get(key, 0) + 1
            c = self._class_of_ref(key, False, t - lt if lt is not None else 0, refs)
            v = self._choose(self._real, self._rule, always, t)
            refused = v is not None and self._refuses(self._real, self._rule, c, key, refs, v, t)
        if not refused:
            return True
        self._bypass[0] = self._req is not None
        c, _ = self._observe(key, touched=False)
        self._shadow_access(key, c)
        self._finish(key, c)
        return False

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._peak = max(self._peak, len(self._sizes))
        c, _ = self._observe(key, touched=False)
        self._n_ins += 1
        self._real.place(key, c)
        self._shadow_access(key, c)
        self._finish(key, c)

    def touch(self, key: Key) -> None:
        self._require(key)
        if self._req is None and self.mode == "challenger":
            self._score[0] += 1  # unhinted: the real cache's per-reference hits
        c, _ = self._observe(key, touched=True)
        self._mark(self._real, key)
        self._real.place(key, c)
        self._shadow_access(key, c)
        self._finish(key, c)

    def remove(self, key: Key) -> None:
        self._drop(key)
        self._real.drop(key)
        for shadow in self._shadows:
            if key in shadow.cls:
                shadow.drop(key)
        self._last.pop(key, None)
        self._lastc.pop(key, None)
        self._refs.pop(key, None)
        self._first.pop(key, None)
        self._fork.pop(key, None)
        self._ends.pop(key, None)
        self._expired.discard(key)

    def evict(self, key: Key) -> None:
        self._drop(key)
        self._real.drop(key)

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        # called before the insert that needs room: ages at the time that reference will get; with
        # second_chance, under the LRU rule, choosing re-queues the marked keys it passes over
        return self._choose_evicting(self._real, self._rule, is_evictable, self._t + 1)
