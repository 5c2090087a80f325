"""The typed errors of ``quillcache.kvquant``: every refusal names the value that caused it.

- ``KVQuantError`` (a ``ValueError``): the base; bad options (a group size that does not divide, an
  unknown granularity) raise it directly.
- ``KVQuantDtypeError`` (also a ``TypeError``): an input whose dtype is not float16 / float32, or
  codes of the wrong dtype.
- ``KVQuantShapeError``: an input that is not ``(tokens, heads, head_dim)`` or whose extents do not
  fit the codec (window longer than the tensor, tokens or channels not divisible by the group).
- ``NonFiniteError``: NaN or ±inf in the input. Quantization REFUSES non-finite values (it never
  saturates them): a KV cache holding inf/NaN is already broken, and a code cannot carry them.
- ``OutOfRangeError``: a finite value with ``|x| > 2**127`` (``MAX_ABS``): its dequantized value could
  overflow to inf (e.g. ``127 * (amax / 127)`` rounding up past float32's maximum), so it is refused.
- ``KVBlockError``: a serialized block that is truncated, corrupted (crc32c), of an unknown
  version / codec, or internally inconsistent; ``field`` says which part is wrong.
"""

from __future__ import annotations

__all__ = ["KVBlockError", "KVQuantDtypeError", "KVQuantError", "KVQuantShapeError", "NonFiniteError", "OutOfRangeError"]


class KVQuantError(ValueError):
    """Bad input or options for a KV codec (the message names the value)."""


class KVQuantDtypeError(KVQuantError, TypeError):
    """An array of a dtype the codec does not take."""


class KVQuantShapeError(KVQuantError):
    """An array whose shape does not fit the codec and its options."""


class NonFiniteError(KVQuantError):
    """NaN or ±inf in a tensor to quantize (refused, never saturated)."""


class OutOfRangeError(KVQuantError):
    """A finite value too large to quantize and dequantize without overflow (``|x| > 2**127``)."""


class KVBlockError(KVQuantError):
    """A serialized block that cannot be decoded; ``field`` names the part that is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"bad KV block ({field}): {message}")
        self.field = field
