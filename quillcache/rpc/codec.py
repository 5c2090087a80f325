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
- Request limits (``with codec.request_limits(): ...``, what a server's dispatcher wraps around decoding a request
  frame of at least :data:`BUDGET_FRAME_BYTES`, for the decodes of its thread; replies and values decoded outside
  it are not limited): an array or map holds at most :data:`MAX_REQUEST_ITEMS` items, and one frame of ``n``
  bytes, with every extension value nested in it (one budget per frame), builds at most
  ``n // BYTES_PER_CONTAINER`` container units (an array is one, a map :data:`MAP_UNITS`) and unpacks at most
  ``EXT_BYTES_FACTOR * n`` bytes of extension payloads. Past a limit ``decode`` raises :class:`RpcProtocolError`
  naming it, as soon as the limit is crossed: what a frame makes the decoder hold is at most that many containers,
  those payloads and one object per other value (each at least one byte on the wire). The densest requests the
  project sends, compact batch rows (an array of six fields: at least 8 bytes), stay within it.
- ``DEFAULT_CODEC`` is the process-wide registry that ``RpcServer`` and ``RpcClient`` use unless given another;
  module-level ``register_type`` / ``register_error`` register there. Every codec knows the RPC layer's own
  ``RpcErrorCode`` and ``RpcRejectedError``.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import msgpack

from quillcache.registry import Registry
from quillcache.rpc.errors import (MAX_QUOTE_CHARS, RpcEncodeError, RpcErrorCode, RpcProtocolError, RpcRejectedError,
                                   clip, quote, quote_each)

__all__ = ["BUDGET_FRAME_BYTES", "BYTES_PER_CONTAINER", "Codec", "DEFAULT_CODEC", "EXT_BYTES_FACTOR",
           "EXT_DATACLASS", "EXT_ENUM", "EXT_TUPLE", "MAP_UNITS", "MAX_EXT_DEPTH", "MAX_REQUEST_ITEMS",
           "register_error", "register_type"]

EXT_DATACLASS = 1
EXT_ENUM = 2
EXT_TUPLE = 3
MAX_EXT_DEPTH = 64  # nested extension values (a dataclass in a tuple in a dataclass ...) allowed on decode
_MAX_DETAIL_CHARS = 4 * MAX_QUOTE_CHARS  # an underlying error's text (msgpack's, a class's check) in a message
# Request limits (module docstring). A request frame smaller than this decodes without the budget's hooks (what it
# can build is bounded by its size); the dispatcher applies the limits from this size up.
BUDGET_FRAME_BYTES = 64 << 10
MAX_REQUEST_ITEMS = 1 << 17  # items of one array or map: 8 x the master's MAX_BATCH_KEYS (the largest real batch)
BYTES_PER_CONTAINER = 4  # frame bytes per container unit allowed
MAP_UNITS = 4  # container units of a map (a Python dict costs about four empty lists)
EXT_BYTES_FACTOR = 8  # extension payload bytes unpacked per frame byte (each level of nesting unpacks its bytes again)


class _Budget:
    """What one request frame may still build (request limits; module docstring): msgpack's hooks for the frame and
    every extension value in it count down."""

    __slots__ = ("frame_bytes", "units", "ext_bytes", "ext_hook")

    def __init__(self, codec: Codec, frame_bytes: int) -> None:
        self.frame_bytes = frame_bytes
        self.units = frame_bytes // BYTES_PER_CONTAINER
        self.ext_bytes = EXT_BYTES_FACTOR * frame_bytes
        self.ext_hook = partial(codec._ext_hook, self)

    def on_list(self, items: list) -> list:
        self.units -= 1
        if self.units < 0:
            self._exceeded()
        return items

    def on_map(self, items: dict) -> dict:
        self.units -= MAP_UNITS
        if self.units < 0:
            self._exceeded()
        return items

    def _ext_exceeded(self) -> None:
        raise RpcProtocolError(f"request frame of {self.frame_bytes} bytes unpacks more than "
                               f"{EXT_BYTES_FACTOR * self.frame_bytes} bytes of nested extension values "
                               f"(EXT_BYTES_FACTOR={EXT_BYTES_FACTOR} per frame byte)")

    def _exceeded(self) -> None:
        raise RpcProtocolError(f"request frame of {self.frame_bytes} bytes builds more than "
                               f"{self.frame_bytes // BYTES_PER_CONTAINER} container units (an array counts 1, a map "
                               f"{MAP_UNITS}; one unit per {BYTES_PER_CONTAINER} bytes of frame: BYTES_PER_CONTAINER)")


class Codec:
    """Encode/decode values for the wire; owns the registries of types and exceptions that may cross it."""

    def __init__(self) -> None:
        self._types: Registry[type] = Registry("rpc wire type")
        self._type_tags: dict[type, str] = {}
        self._errors: Registry[type] = Registry("rpc error type")
        self._error_tags: dict[type, str] = {}
        self._local = threading.local()  # per decoding thread: ext nesting ``depth``, ``limits`` (request_limits)
        self._init_fields: dict[type, frozenset[str]] = {}  # a registered dataclass's constructor fields
        self._plain_ext_hook = partial(self._ext_hook, None)  # outside the request limits
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
        """The value ``data`` encodes; :class:`RpcProtocolError` (only) for anything else. Within
        :meth:`request_limits`, under the request limits (module docstring)."""
        budget = _Budget(self, len(data)) if getattr(self._local, "limits", False) else None
        try:
            return self._unpack(data, budget)
        except RpcProtocolError:
            raise
        except Exception as e:  # msgpack's many errors, an ext hook's, a class's __post_init__
            raise RpcProtocolError(f"undecodable frame of {len(data)} bytes: {type(e).__name__}: "
                                   f"{clip(str(e), _MAX_DETAIL_CHARS)}") from e
        finally:
            self._local.depth = 0

    @contextmanager
    def request_limits(self) -> Iterator[None]:
        """``decode`` on this thread, within the block, applies the request limits (module docstring)."""
        local = self._local
        outer = getattr(local, "limits", False)
        local.limits = True
        try:
            yield
        finally:
            local.limits = outer

    def _unpack(self, data: bytes | bytearray | memoryview, budget: _Budget | None) -> object:
        if budget is None:
            return msgpack.unpackb(data, ext_hook=self._plain_ext_hook, raw=False, strict_map_key=False,
                                   use_list=True)
        return msgpack.unpackb(data, ext_hook=budget.ext_hook, raw=False, strict_map_key=False, use_list=True,
                               list_hook=budget.on_list, object_hook=budget.on_map,
                               max_array_len=MAX_REQUEST_ITEMS, max_map_len=MAX_REQUEST_ITEMS)

    def _ext_hook(self, budget: _Budget | None, code: int, data: bytes) -> object:
        """msgpack's hook for an extension value, through ``_plain_ext_hook`` or ``budget.ext_hook``."""
        local = self._local
        depth = getattr(local, "depth", 0) + 1
        if depth > MAX_EXT_DEPTH:
            raise RpcProtocolError(f"extension values nested deeper than {MAX_EXT_DEPTH}")
        if budget is not None:
            budget.ext_bytes -= len(data)
            if budget.ext_bytes < 0:
                budget._ext_exceeded()
        local.depth = depth
        try:
            if code == EXT_TUPLE:
                items = self._unpack(data, budget)
                if not isinstance(items, list):
                    raise RpcProtocolError(f"tuple extension holds a {type(items).__name__}, not an array")
                return tuple(items)
            if code not in (EXT_DATACLASS, EXT_ENUM):
                raise RpcProtocolError(f"unknown msgpack extension type {code}")
            body = self._unpack(data, budget)
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
            local.depth = depth - 1


DEFAULT_CODEC = Codec()
register_type = DEFAULT_CODEC.register_type
register_error = DEFAULT_CODEC.register_error
