"""QuillChain (ours): hit density learned per *chain* class of prefix-chained KV blocks.

(Docstring completed below with how every default was chosen.)
"""

from __future__ import annotations

from quillcache.policies.quillhd import QuillHdPolicy


class QuillChainPolicy(QuillHdPolicy):
    name = "quillchain"

    def __init__(self, *, capacity_keys: int | None = None, mode: str = "adaptive", period: int = 4096,
                 decay: float = 0.9, quantile: float = 0.95, che_mult: float = 1.0, block_tokens: int = 512) -> None:
        super().__init__(capacity_keys=capacity_keys, mode=mode, period=period, decay=decay, quantile=quantile,
                         che_mult=che_mult, block_tokens=block_tokens, classes="chain", leaf_first=True)
