"""``Tokenizer``: text <-> token ids, shared by the stand-in engine and the gateway so both count the same tokens.

Two implementations, registered by name in :data:`TOKENIZERS`:

- ``"bytes"`` — :class:`ByteTokenizer`, the stated TEST FALLBACK: one token per UTF-8 byte (ids 0..255), no
  special tokens. ``decode(encode(s)) == s`` for every ``str`` without lone surrogates.
- ``"hf"`` — :class:`HfTokenizer`, a HuggingFace ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` path
  (the file an engine ships with its model). ``add_special_tokens`` is passed through (vLLM adds them for
  ``/v1/completions`` prompts and not for chat prompts, whose template already holds them).

:func:`load_tokenizer` turns a spec into one: ``"bytes"`` (or ``None``), or a path to a ``tokenizer.json`` (or to a
directory that holds one). Invariants: ``encode`` returns a fresh ``list[int]`` of ids in ``[0, vocab_size)``
(``encode_array``, where a tokenizer has it, the same ids as a fresh ``uint32`` array);
``decode`` refuses ids outside that range with ``ValueError`` naming the first bad one and its position; a
non-``str`` text raises ``TypeError``; a ``str`` that is not encodable as UTF-8 (a lone surrogate, which a JSON
``\\ud800`` escape gives) raises ``TokenizerError`` naming its position, from every tokenizer alike. Nothing here
holds per-request state, so one instance serves every request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from quillcache.registry import Registry

__all__ = ["TOKENIZERS", "ByteTokenizer", "HfTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or ids/text it was given are invalid (the message names which)."""


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. ``name`` identifies the vocabulary (it enters the gateway's identity scope)."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    return text


def _check_ids(ids: object, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"ids must be a sequence of int, got {type(ids).__name__}")
    out = list(ids)  # type: ignore[arg-type]
    for pos, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"ids[{pos}] must be int, got {type(v).__name__} {v!r:.40}")
        if not 0 <= v < vocab_size:
            raise TokenizerError(f"ids[{pos}]={v} is outside the vocabulary [0, {vocab_size})")
    return out


def _unencodable(text: str, e: UnicodeEncodeError | None = None) -> TokenizerError:
    """The error for a ``str`` that is not UTF-8 (a lone surrogate), naming where."""
    if e is None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as found:
            e = found
    if e is None:  # pragma: no cover - called only for text a tokenizer refused
        return TokenizerError("text cannot be tokenized")
    return TokenizerError(f"text is not encodable as UTF-8 at position {e.start}: {e.reason}")


@dataclass(frozen=True)
class ByteTokenizer:
    """TEST FALLBACK tokenizer: one token per UTF-8 byte (ids 0..255), no special tokens."""

    name: str = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        try:
            return list(_check_text(text).encode("utf-8"))
        except UnicodeEncodeError as e:
            raise _unencodable(text, e) from None

    def encode_array(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """``encode`` as a fresh ``uint32`` array (the same ids, without a Python int per byte)."""
        try:
            return np.frombuffer(_check_text(text).encode("utf-8"), dtype=np.uint8).astype(np.uint32)
        except UnicodeEncodeError as e:
            raise _unencodable(text, e) from None

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(_check_ids(ids, 256))
        # a cut inside a multi-byte character (e.g. a stream split) decodes to U+FFFD, never raises
        return data.decode("utf-8", errors="replace")


class HfTokenizer:
    """A HuggingFace ``tokenizers`` tokenizer from a ``tokenizer.json`` file."""

    def __init__(self, path: str | Path, *, name: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise TokenizerError(f"no tokenizer.json at {str(path)!r}")
        try:
            from tokenizers import Tokenizer as _HfTok
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise TokenizerError(f"the 'tokenizers' package is needed for {str(p)!r}: {e}") from None
        try:
            self._tok = _HfTok.from_file(str(p))
        except Exception as e:  # the library raises its own Exception subclass on a bad file
            raise TokenizerError(f"{str(p)!r} is not a valid tokenizer.json: {e}") from None
        self.path = p
        self.name = name or f"hf:{p.parent.name or p.name}"
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        text = _check_text(text)
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except (TypeError, UnicodeError):  # the library's TypeError for a str it cannot convert (lone surrogate)
            raise _unencodable(text) from None

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self._ids(text, add_special_tokens))

    def encode_array(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        """``encode`` as a fresh ``uint32`` array."""
        return np.asarray(self._ids(text, add_special_tokens), dtype=np.uint32)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(_check_ids(ids, self._vocab_size), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"HfTokenizer({str(self.path)!r}, vocab_size={self._vocab_size})"


TOKENIZERS: Registry = Registry("tokenizer")
TOKENIZERS.register("bytes", ByteTokenizer)
TOKENIZERS.register("hf", HfTokenizer)


def load_tokenizer(spec: str | Path | None = None) -> Tokenizer:
    """``None``/``"bytes"`` -> :class:`ByteTokenizer`; ``"hf:PATH"`` or a path -> :class:`HfTokenizer`."""
    if spec is None or spec == "bytes":
        return TOKENIZERS.create("bytes")
    text = str(spec)
    if text.startswith("hf:"):
        text = text[3:]
    if not text:
        raise TokenizerError("empty tokenizer spec; give 'bytes' or a path to a tokenizer.json")
    return TOKENIZERS.create("hf", path=text)
