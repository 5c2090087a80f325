"""``Codec``: msgpack plus a registry of the project's dataclasses, enums and exceptions.

Contract:
- Native msgpack values pass as they are: ``None``, ``bool``, ints in ``[-2**63, 2**64)``, floats (as doubles),
  ``str``, ``bytes`` (``bytearray`` and ``memoryview`` are sent as bytes and come back as ``bytes``), lists, and
  dicts (keys of any decodable hashable kind). NumPy integers and floats are sent as Python ints and floats.
- Three msgpack extension types carry what msgpack lacks, so a value comes back with the type it left with:
  ``EXT_DATACLASS`` = ``[tag, {field: value}]`` (the ``init`` fields; rebuilt by calling the class, so its
  ``__post_init__`` checks run again), ``EXT_ENUM`` = ``[tag, member name]``, ``EXT_TUPLE`` = the items. Nesting is
  free (a dataclass of tuples of enums); extension nesting deeper than ``MAX_EXT_DEPTH`` is refused.
- Only registered classes cross the wire: ``register_type(cls)`` for a dataclass or an enum, ``register_error(cls)``
  for an exception. The tag is ``name`` or ``cls.__qualname__``; registering the same class again under the same
  tag is a no-op, another class under a taken tag raises ``ValueError``. Encoding an unregistered dataclass or
  enum raises :class:`RpcEncodeError` naming it and ``register_type``.
- ``decode`` raises only :class:`RpcProtocolError`, whatever the bytes (fuzzed in ``tests/test_rpc.py``); its
  message quotes what it refuses with :func:`~quillcache.rpc.errors.quote` (bounded, whatever the frame holds).
- ``DEFAULT_CODEC`` is the process-wide registry that ``RpcServer`` and ``RpcClient`` use unless given another;
  module-level ``register_type`` / ``register_error`` register there. Every codec knows the RPC layer's own
  ``RpcErrorCode`` and ``RpcRejectedError``.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import threading
from collections.abc import Mapping

import msgpack

from quillcache.registry import Registry
from quillcache.rpc.errors import (MAX_QUOTE_CHARS, RpcEncodeError, RpcErrorCode, RpcProtocolError, RpcRejectedError,
                                   clip, quote, quote_each)

__all__ = ["Codec", "DEFAULT_CODEC", "EXT_DATACLASS", "EXT_ENUM", "EXT_TUPLE", "MAX_EXT_DEPTH",
           "register_error", "register_type"]

EXT_DATACLASS = 1
EXT_ENUM = 2
EXT_TUPLE = 3
MAX_EXT_DEPTH = 64  # nested extension values (a dataclass in a tuple in a dataclass ...) allowed on decode
_MAX_DETAIL_CHARS = 4 * MAX_QUOTE_CHARS  # an underlying error's text (msgpack's, a class's check) in a message


class Codec:
    """Encode/decode values for the wire; owns the registries of types and exceptions that may cross it."""

    def __init__(self) -> None:
        self._types: Registry[type] = Registry("rpc wire type")
        self._type_tags: dict[type, str] = {}
        self._errors: Registry[type] = Registry("rpc error type")
        self._error_tags: dict[type, str] = {}
        self._depth = threading.local()
        self._init_fields: dict[type, frozenset[str]] = {}  # a registered dataclass's constructor fields
        self.register_type(RpcErrorCode)
        self.register_error(RpcRejectedError)

    # --- registries ---------------------------------------------------------------------------------

    def register_type(self, cls: type, name: str | None = None) -> type:
        """Let dataclass or enum ``cls`` cross the wire under ``name`` (default ``cls.__qualname__``)."""
        if not isinstance(cls, type) or not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
            raise TypeError(f"register_type takes a dataclass or an enum class, got {cls!r}")
        self._register(self._types, self._type_tags, cls, name)
        if dataclasses.is_dataclass(cls):
            self._init_fields[cls] = frozenset(f.name for f in dataclasses.fields(cls) if f.init)
        return cls

    def register_error(self, cls: type, name: str | None = None) -> type:
        """Raise ``cls`` (and unregistered subclasses, as ``cls``) client-side when the server raises it."""
        if not isinstance(cls, type) or not issubclass(cls, BaseException):
            raise TypeError(f"register_error takes an exception class, got {cls!r}")
        code = getattr(cls, "code", None)
        if isinstance(code, enum.Enum) and type(code) not in self._type_tags:
            self.register_type(type(code))  # a class-level code's enum crosses the wire with the error
        return self._register(self._errors, self._error_tags, cls, name)

    @staticmethod
    def _register(registry: Registry[type], tags: dict[type, str], cls: type, name: str | None) -> type:
        tag = cls.__qualname__ if name is None else name
        if tags.get(cls) == tag:
            return cls
        if cls in tags:
            raise ValueError(f"{cls.__qualname__} is already registered as {tags[cls]!r}, not {tag!r}")
        if tag in registry:
            raise ValueError(f"{registry.kind} tag {tag!r} is already taken by {registry[tag]!r}; "
                             f"pass name= to register {cls!r}")
        registry.register(tag, cls)
        tags[cls] = tag
        return cls

    def type_names(self) -> list[str]:
        return self._types.names()

    def error_tag(self, cls: type) -> str | None:
        """The tag of ``cls`` or of its nearest registered ancestor; None when none is registered."""
        for base in cls.__mro__:
            tag = self._error_tags.get(base)
            if tag is not None:
                return tag
        return None

    def error_class(self, tag: str) -> type | None:
        return self._errors.get(tag, None)  # type: ignore[return-value]

    # --- encoding -----------------------------------------------------------------------------------

    def encode(self, value: object) -> bytes:
        try:
            return msgpack.packb(value, default=self._default, strict_types=True, use_bin_type=True)
        except RpcEncodeError:
            raise
        except (TypeError, ValueError, OverflowError) as e:
            raise RpcEncodeError(f"cannot encode {type(value).__name__}: {e}") from e

    def _default(self, obj: object) -> object:
        """msgpack's hook for everything that is not exactly a native type (``strict_types``)."""
        cls = type(obj)
        tag = self._type_tags.get(cls)
        if tag is not None:
            if isinstance(obj, enum.Enum):
                return msgpack.ExtType(EXT_ENUM, self._pack([tag, obj.name]))
            body = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}  # type: ignore[arg-type]
            return msgpack.ExtType(EXT_DATACLASS, self._pack([tag, body]))
        if cls is tuple:
            return msgpack.ExtType(EXT_TUPLE, self._pack(list(obj)))  # type: ignore[arg-type]
        if isinstance(obj, enum.Enum) or dataclasses.is_dataclass(obj):
            raise RpcEncodeError(f"{cls.__module__}.{cls.__qualname__} is not registered with this codec; "
                                 f"call quillcache.rpc.register_type({cls.__qualname__}) on both sides")
        if isinstance(obj, tuple):  # a namedtuple: its items, as a tuple
            return msgpack.ExtType(EXT_TUPLE, self._pack(list(obj)))
        if isinstance(obj, bool) or type(obj).__name__ == "bool_":
            return bool(obj)
        if isinstance(obj, numbers.Integral):
            return int(obj)
        if isinstance(obj, numbers.Real):
            return float(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        if isinstance(obj, Mapping):
            return dict(obj)
        if isinstance(obj, list):
            return list(obj)
        raise RpcEncodeError(f"cannot encode a {cls.__module__}.{cls.__qualname__} ({quote(obj)}); "
                             f"send native values, tuples, or registered dataclasses and enums")

    def _pack(self, obj: object) -> bytes:
        return msgpack.packb(obj, default=self._default, strict_types=True, use_bin_type=True)

    # --- decoding -----------------------------------------------------------------------------------

    def decode(self, data: bytes | bytearray | memoryview) -> object:
        """The value ``data`` encodes; :class:`RpcProtocolError` (only) for anything else."""
        try:
            return self._unpack(data)
        except RpcProtocolError:
            raise
        except Exception as e:  # msgpack's many errors, an ext hook's, a class's __post_init__
            raise RpcProtocolError(f"undecodable frame of {len(data)} bytes: {type(e).__name__}: "
                                   f"{clip(str(e), _MAX_DETAIL_CHARS)}") from e
        finally:
            self._depth.n = 0

    def _unpack(self, data: bytes | bytearray | memoryview) -> object:
        return msgpack.unpackb(data, ext_hook=self._ext_hook, raw=False, strict_map_key=False, use_list=True)

    def _ext_hook(self, code: int, data: bytes) -> object:
        depth = getattr(self._depth, "n", 0) + 1
        if depth > MAX_EXT_DEPTH:
            raise RpcProtocolError(f"extension values nested deeper than {MAX_EXT_DEPTH}")
        self._depth.n = depth
        try:
            if code == EXT_TUPLE:
                items = self._unpack(data)
                if not isinstance(items, list):
                    raise RpcProtocolError(f"tuple extension holds a {type(items).__name__}, not an array")
                return tuple(items)
            if code not in (EXT_DATACLASS, EXT_ENUM):
                raise RpcProtocolError(f"unknown msgpack extension type {code}")
            body = self._unpack(data)
            if not (isinstance(body, list) and len(body) == 2 and isinstance(body[0], str)):
                raise RpcProtocolError(f"extension {code} must hold [tag, value], got {quote(body)}")
            tag, value = body
            cls = self._types.get(tag, None)
            if cls is None:
                raise RpcProtocolError(f"unknown type tag {quote(tag)}; registered: {sorted(self._types.names())}")
            if code == EXT_ENUM:
                if not issubclass(cls, enum.Enum):  # type: ignore[arg-type]
                    raise RpcProtocolError(f"type tag {quote(tag)} is not an enum")
                if not isinstance(value, str) or value not in cls.__members__:  # type: ignore[attr-defined]
                    raise RpcProtocolError(f"{tag} has no member {quote(value)}")
                return cls[value]  # type: ignore[index]
            if not dataclasses.is_dataclass(cls) or not isinstance(value, dict) \
                    or not all(isinstance(k, str) for k in value):
                raise RpcProtocolError(f"type tag {quote(tag)} with {type(value).__name__} is not a dataclass's "
                                       f"fields")
            fields = self._init_fields[cls]  # type: ignore[index]
            unknown = [k for k in value if k not in fields]
            if unknown:
                raise RpcProtocolError(f"cannot rebuild {tag}: it has no field {quote_each(unknown)}")
            try:
                return cls(**value)  # type: ignore[operator]
            except Exception as e:
                raise RpcProtocolError(f"cannot rebuild {tag} from fields {quote(sorted(value))}: "
                                       f"{type(e).__name__}: {clip(str(e), _MAX_DETAIL_CHARS)}") from e
        finally:
            self._depth.n = depth - 1


DEFAULT_CODEC = Codec()
register_type = DEFAULT_CODEC.register_type
register_error = DEFAULT_CODEC.register_error
