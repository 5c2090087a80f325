"""QuillChain (ours): hit density learned per *chain* class of prefix-chained KV blocks, with
admission by hit density.

What it uses of the structure of prefix-chained KV (and nothing of the future):

- **Session turns.** A conversation's next turn re-sends the whole previous conversation, so a
  new block's chance of coming back is its *session's* chance of another turn. Online metadata
  counts, for every block, how many requests *ended* on it (their last full block); a request's
  "turns" = the number of blocks on its known prefix where some earlier request ended
  (``min(ends, 1)`` each, so a shared system prompt on which many requests ended counts once),
  bucketed 0, 1, 2, 3-4, 5-8, >= 9.
- **Shared prompts and frequency.** A block that is a prefix hit and was referenced before is
  classed by its reference count (2, 3, 4-7, 8-15, >= 16): system prompts shared by many
  sessions climb those classes whatever the turn count of the request.
- **Forks: a shared prefix is worth its own rate** (``shared_rate=True``). A request whose known
  prefix (blocks seen before) ends inside it, at a block where no earlier request ended, has
  branched off a shared prefix: a new conversation on a system prompt, not the next turn of a
  conversation (which extends its chain exactly where its previous request ended). Every block of
  that prefix counts a fork. A block with a fork and at least ``RATE_MIN_REFS`` (4) references is
  worth, when its class's density is lower, its own rate while in use,
  ``r = (refs - 1) / (last - first)``, discounted by how long it has been silent for that rate:
  ``r * exp(-age * r / RATE_SILENCE_GAPS)`` (4 mean gaps). Why: densities are learned per class up
  to the learning horizon, past which a class's density is 0 by construction, so class densities
  alone dropped popular prompts whose gaps are longer than the horizon (and, before anything was
  learned, every prompt), which is where S3-FIFO and SIEVE, keeping whatever was hit, won. Session
  history never forks, so a finished conversation's blocks are not kept by their past rate.
- **First sight.** Every other full block is classed by the request's turn bucket and whether it
  was seen before (a block coming back after an eviction is not a one-hit block).
- **A shared prefix used again while cached gets a second chance under the LRU rule**
  (``second_chance=True``). A cached block touched with at least two references and a fork is
  marked; when the LRU rule would evict a marked block it unmarks it and re-queues it at the tail
  of its class instead, at most ``second_chance_max(block_tokens)`` times per eviction (64 at
  512-token blocks, ``SECOND_CHANCE_TOKENS`` = 32,768 prompt tokens' worth at any size). Why:
  prompts used a few times with gaps of hundreds of requests were what SIEVE and S3-FIFO kept and
  the LRU rule dropped (``quillcache.hitrate.anatomy``); SIEVE's visited bit, limited to shared
  prefixes, keeps them.
- **Partial last blocks.** A request's last block when ``input_tokens % block_tokens != 0`` has
  its own class: the next turn fills it with more tokens, so engines never reuse it as a prefix.
- **A chain is only as good as its prefix.** After each request its cached blocks are re-queued
  deepest first, so within a class a chain loses its leaves before its root; and when a new
  block is not admitted (below), no later new block of the same request is (none of them could
  be a prefix hit without it).

18 classes in all (``quillcache.policies.quillhd.chain_class``). Per class and age, hit density
(expected hits per unit of cache space-time; LHD's estimator on ghost lifetimes, as in
``quillcache.policies.quillhd``) is learned online; the victim is the class head with the lowest
density (a forked shared block: at least its rate, above). **Admission** (``admit=True``): when
the cache is full and the hit-density rule is in force, a new block worth less than its victim is
not stored (a refused block is still a reference: it is learned from). This is what keeps a
stable subset of long conversations when they do not all fit, instead of cycling through them as
LRU does. Both sides are valued the same way: the new block is worth its class's density at age 0
or, if it is a forked shared block with enough references, its own rate ``(refs - 1) / (t -
first)`` when that is higher, so a shared prompt that comes back after an eviction is judged by
its rate and not by the class of a block that is missing from a request's prefix (which its
blocks fall into once the first one misses). The default ``mode="challenger"`` guards the rule:
one metadata-only shadow cache runs the other rule (partial tails first, then the globally least
recent block, no admission); every ``period`` references the two swap rules if the shadow had
more decayed prefix hits. The real cache starts on the LRU rule and the shadow on the hit-density
rule (``start_rule="lru"``): densities learned from nothing are not trusted with the real cache
until they have beaten LRU over a period.

How every default was chosen (never on the conversation trace alone). Each was compared with
its alternatives by the number of (trace, seed, capacity) cells in which QuillChain beats LRU,
SIEVE and S3-FIFO (ties lose), on generated traces - the generalisation cells of
``experiments/hitrate_study.py`` (generated session shapes x seeds and the synthetic trace, at
1/3/10/30% of each trace's distinct blocks), session shapes drawn at random from the generator's
knobs at seeds the study does not use, and the same shapes cut into 16-token blocks - with the
gap closed on the conversation trace at 1k-50k blocks as a check, never as the criterion. The
measurements as they stood when each choice was made are in ``docs/hitrate_tuning_log.md``
(historical); every full study run re-measures the defaults against their alternatives (summary
rows ``defaults_check``, raw ``results/hitrate/defaults_check.csv``, listed in the report).
- the turn buckets and the power-of-two reference-count buckets were fixed before measuring; the
  class layout (reference counts for prefix hits, first-seen vs seen-before for the rest) and
  admission were kept because they won more cells; ``block_tokens = 512`` is the Mooncake /
  generated traces' block size (set it to the engine's);
- the fork gate, ``RATE_MIN_REFS = 4`` and the smooth ``exp`` discount won more cells than a
  per-block rate without the gate (which keeps finished conversations), than fewer or more
  references, and than a hard cut-off after a number of mean gaps; ``RATE_SILENCE_GAPS`` values
  around 4 won the same cells;
- valuing the incoming block by its own rate in admission (as the victim already was) won more
  random-shape cells, where S3-FIFO had kept tenant prompts that QuillChain refused to re-admit;
- ``period`` counts references of 512-token blocks (``period_refs``): with ``block_tokens = b`` the
  learning and challenger period is ``period * 512 / b`` references, the same span of prompt
  tokens, because learned densities decay by ``decay`` every period and a period fixed in
  references gave small blocks a memory shorter in requests than the traces its value was chosen
  on; it won more 16-token cells and changes nothing at 512-token blocks;
- a period lasts at most the cache's capacity in blocks (``cap_period=True``;
  ``quillcache.policies.quillhd.learning_period``, at least ``PERIOD_MIN_REFS`` references so that
  the O(classes x age buckets) update stays a small share of each reference): with a period fixed
  in references a small cache learned from history many of its own lifetimes old and swapped rules
  as rarely as a large one. It won more random-shape and 16-token cells; periods of a fraction or
  a multiple of the capacity won fewer, and a capacity-long period without the upper bound learned
  too rarely in large caches;
- the real cache starts on the LRU rule and the challenger shadow on the hit-density rule
  (``start_rule="lru"``): with the HD rule from the start, the first evictions and refusals of a
  large cache were made with densities learned before anything was evicted, and the later swap to
  the LRU rule came too late (a swap hands each rule the content the other built). It won more
  random-shape, table and 16-token cells; its cost is a smaller gap closed at 1k blocks on the
  conversation trace, where the first period of a small cache runs the LRU rule. Not kept: waiting
  after a swap before comparing again, comparing once per capacity of insertions, and an LRU rule
  that first evicts blocks whose class density at their age is 0;
- ``period = 2048`` came from a sweep of period x quantile x che_mult scored the same way;
  ``decay``, ``quantile``, ``che_mult`` and the challenger mode are QuillHD's values. Some
  alternatives (``mode="adaptive"``, ``period=1024``) close more of the gap in more cells than they
  lose but beat all three baselines in fewer cells: the defaults favour never losing to a simple
  policy over a higher median;
- ``second_chance`` won more random-shape cells and kept the table's, with larger margins; a mark
  for every touched block (not only shared prefixes) won fewer;
- the second-chance bound counts prompt tokens, not blocks (``SECOND_CHANCE_TOKENS``, 64 blocks of
  512 tokens): at 16-token blocks a bound in blocks ran out inside one prompt, after which the LRU
  rule evicted a marked shared prefix anyway; counted in tokens it won more 16-token cells and
  changes nothing where it does not bind.

Memory: like QuillHD, reference metadata for every key ever seen (plus an end counter, a fork
counter, the time of the first reference and a second-chance mark per cache instance).
Exactness: ``quillcache.hitrate.kernels.quillhd`` with ``classes=CLS_CHAIN, leaf_first=True``,
``admit``, ``shared`` and ``second`` is its compiled twin; the two agree hit for hit (tested on random traces).
"""

from __future__ import annotations

from quillcache._checks import check_int
from quillcache.policies.base import MAX_BLOCK_TOKENS
from quillcache.policies.quillhd import MAX_PERIOD_REFS, QuillHdPolicy

PERIOD_BLOCK_TOKENS = 512  # ``period`` counts references of blocks of this many tokens


def period_refs(period: int, block_tokens: int) -> int:
    """The learning / challenger period in references of ``block_tokens``-token blocks: ``period``
    references of 512-token blocks, i.e. the same number of prompt tokens whatever the block size
    (at least one reference). Both QuillChain and its kernel runner use this one conversion.
    ``period`` is at most ``MAX_PERIOD_REFS // PERIOD_BLOCK_TOKENS`` and ``block_tokens`` at most
    ``MAX_BLOCK_TOKENS`` (ValueError naming it), so the result is at most ``MAX_PERIOD_REFS``."""
    period = check_int("period", period, 1, MAX_PERIOD_REFS // PERIOD_BLOCK_TOKENS)
    block_tokens = check_int("block_tokens", block_tokens, 1, MAX_BLOCK_TOKENS)
    return max(1, round(period * PERIOD_BLOCK_TOKENS / block_tokens))


class QuillChainPolicy(QuillHdPolicy):
    name = "quillchain"

    def __init__(self, *, capacity_keys: int | None = None, mode: str = "challenger", period: int = 2048,
                 decay: float = 0.9, quantile: float = 0.95, che_mult: float = 1.0, block_tokens: int = 512,
                 admit: bool = True, shared_rate: bool = True, second_chance: bool = True,
                 cap_period: bool = True, start_rule: str = "lru") -> None:
        period = period_refs(period, block_tokens)  # self.period is in references of this block size
        super().__init__(capacity_keys=capacity_keys, mode=mode, period=period, decay=decay, quantile=quantile,
                         che_mult=che_mult, block_tokens=block_tokens, classes="chain", leaf_first=True, admit=admit,
                         shared_rate=shared_rate, second_chance=second_chance, cap_period=cap_period,
                         start_rule=start_rule)
