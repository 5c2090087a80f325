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
- ``mode``, ``period``, ``decay``, ``quantile`` and ``che_mult`` were checked against
  alternatives on every generalisation cell of ``experiments/hitrate_study.py`` (six generated
  session shapes x 3 seeds and the synthetic trace, at 1/3/10/30% of each trace's distinct
  blocks: 76 cells; summary rows ``defaults_check``, raw ``results/hitrate/defaults_check.csv``).
  Full-profile run, median share of the LRU-to-Belady gap closed (defaults: 21.2%) and cells
  better / worse than the defaults by more than one point: ``mode="adaptive"`` (two shadows)
  21.3%, 6 / 9; ``"hd"`` (no guard) 8.7%, 10 / 42; ``"lru"`` 8.0%, 13 / 40; ``period=1024``
  21.4%, 25 / 23; ``period=16384`` 16.7%, 10 / 36; ``decay=0.5`` 17.8%, 15 / 33; ``che_mult=4``
  20.8%, 12 / 20; ``quantile=0.8`` 19.9%, 7 / 29. No alternative is better in most cells, so
  the defaults (QuillHD's values; the challenger guard, ~1.5x faster than two shadows) stay.

Memory: like QuillHD, reference metadata for every key ever seen (plus one end counter).
Exactness: ``quillcache.hitrate.kernels.quillhd`` with ``classes=CLS_CHAIN, leaf_first=True``
is its compiled twin; the two agree hit for hit (tested on random traces).
"""

from __future__ import annotations

from quillcache.policies.quillhd import QuillHdPolicy


class QuillChainPolicy(QuillHdPolicy):
    name = "quillchain"

    def __init__(self, *, capacity_keys: int | None = None, mode: str = "challenger", period: int = 2048,
                 decay: float = 0.9, quantile: float = 0.95, che_mult: float = 1.0, block_tokens: int = 512,
                 admit: bool = True) -> None:
        super().__init__(capacity_keys=capacity_keys, mode=mode, period=period, decay=decay, quantile=quantile,
                         che_mult=che_mult, block_tokens=block_tokens, classes="chain", leaf_first=True, admit=admit)
