"""QuillChain (ours): hit density learned per *chain* class of prefix-chained KV blocks.

What it uses of the structure of prefix-chained KV (and nothing of the future):

- **Session turns.** A conversation's next turn re-sends the whole previous conversation, so a
  block's chance of coming back is its *session's* chance of another turn, not the block's own
  reference count (a block written at turn 5 has been seen once, but its session has returned
  five times). Online metadata counts, for every block, how many requests *ended* on it (their
  last full block); a request's "turns" = the number of blocks on its known prefix where some
  earlier request ended (``min(ends, 1)`` each, so a shared system prompt on which many
  requests ended counts once). Its blocks are classed by turns: 0, 1, 2, 3-4, 5-8, >= 9.
- **Shared prompts.** A prefix-hit block referenced >= 4 times is "hot" (its own class): system
  prompts shared by every session live there, whatever the turn count of the request.
- **Partial last blocks.** A request's last block when ``input_tokens % block_tokens != 0`` has
  its own class: the next turn fills it with more tokens, so engines never reuse it as a prefix.
- **A child is never more useful than its parent.** After each request its cached blocks are
  re-queued deepest first, so within a class a chain loses its leaves before its root and the
  cache never keeps a descendant whose ancestor is gone (it could not hit).

Per class and age, hit density (expected hits per unit of cache space-time; LHD's estimator on
ghost lifetimes, as in ``quillcache.policies.quillhd``) is learned online; the victim is the class
head with the lowest density. The default ``mode="challenger"`` guards it: one metadata-only
shadow cache runs the other rule (partial tails first, then the globally least recent block);
every ``period`` references the two swap rules if the shadow had more decayed prefix hits.

How every default was chosen (never on the conversation trace alone):
- ``HOT_REFS = 4`` and the turn buckets are QuillHD's reference-count cap and a log-like split
  of the turn counts, fixed before any measurement; ``block_tokens = 512`` is the Mooncake /
  generated traces' block size (set it to the engine's).
- ``mode="challenger"`` against ``"adaptive"`` (two shadows), on the generated shapes of
  ``experiments/hitrate_study.py`` (``GEN_SHAPES``, seed 1, 800 sessions: base, long sessions,
  high rate, single turn) at 1/3/10/30% of their distinct blocks: equal within 1 point of the
  LRU-to-Belady gap in 14 of 16 cells, better by 4.7 in one (single turn, 1%), worse by 7.7 in
  one (high rate, 30%); one shadow instead of two replays ~1.5x faster. ``"hd"`` alone loses to
  LRU at 30% on three of the four shapes, which is why a guard exists.
- ``period=4096``, ``decay=0.9``, ``quantile=0.95``, ``che_mult=1``: QuillHD's, kept because no
  alternative tried was better on most cells of the same generated shapes: ``period=1024`` was
  better in 7 of 16 cells and worse in 9 (every cell of long sessions); ``che_mult=4`` better by
  more than 1 point in none, worse by up to 9.7; ``quantile=0.99`` with ``che_mult=2`` better in
  5 and worse in 8.

Memory: like QuillHD, reference metadata for every key ever seen (plus one end counter).
Exactness: ``quillcache.hitrate.kernels.quillhd`` with ``classes=CLS_CHAIN, leaf_first=True``
is its compiled twin; the two agree hit for hit (tested on random traces).
"""

from __future__ import annotations

from quillcache.policies.quillhd import QuillHdPolicy


class QuillChainPolicy(QuillHdPolicy):
    name = "quillchain"

    def __init__(self, *, capacity_keys: int | None = None, mode: str = "challenger", period: int = 4096,
                 decay: float = 0.9, quantile: float = 0.95, che_mult: float = 1.0, block_tokens: int = 512) -> None:
        super().__init__(capacity_keys=capacity_keys, mode=mode, period=period, decay=decay, quantile=quantile,
                         che_mult=che_mult, block_tokens=block_tokens, classes="chain", leaf_first=True)
