"""Block hashing: Dynamo-compatible XXH3-64 chains and keyed BLAKE2b digests (public API).

``blocks.py`` validates and dispatches; ``_xxh3.py`` is the Numba XXH3 kernel, checked bit for bit
against the ``xxhash`` library (the plain reference) in the tests.
"""

from quillcache.hashing.blocks import (
    DYNAMO_BASE_SEED,
    MAX_BLOCK_SIZE,
    as_token_array,
    check_block_size,
    hash_blocks,
    hash_blocks_batch,
    hash_seed,
    local_hashes,
    salted_block_digests,
    salted_hash_blocks,
    xxh3_64,
)

__all__ = [
    "DYNAMO_BASE_SEED",
    "MAX_BLOCK_SIZE",
    "as_token_array",
    "check_block_size",
    "hash_blocks",
    "hash_blocks_batch",
    "hash_seed",
    "local_hashes",
    "salted_block_digests",
    "salted_hash_blocks",
    "xxh3_64",
]
