"""Count-min sketch with conservative update, aging, merge and top-k (public API).

``countmin.py`` is the validating API over the Cython core ``_sketch.pyx``; ``reference.py`` is the
plain-Python specification both are tested against.
"""

from quillcache.sketch.countmin import (
    CountMinSketch,
    SketchConfig,
)

__all__ = [
    "CountMinSketch",
    "SketchConfig",
]
