"""Adaptive radix tree in one offset-addressed arena (public API).

``tree.py`` holds ``ArtTree`` (the validating API over the Cython core in ``_art*.pyx``) and
``ArtReference`` (the plain-Python specification); the invariants are stated in ``tree.py``.
"""

from quillcache.art.meta import ArenaMeta
from quillcache.art.tree import (
    ArtTree,
    ArtReference,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    DEFAULT_CHUNK_BYTES,
)

__all__ = [
    "ArenaMeta",
    "ArtReference",
    "ArtTree",
    "DEFAULT_CHUNK_BYTES",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
]
