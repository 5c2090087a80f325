"""``Registry``: named implementations of one kind (policies, routers, index backends, kernels, commands).

Contract:
- ``register(name, obj)`` (or ``@registry.register(name)``) adds an entry; registering a name twice
  raises ``ValueError`` (a second registration is a bug, not an override). ``registry[name] = obj``
  is the same call (so ``pytest``'s ``monkeypatch.setitem`` can add a test-only entry), and
  ``del registry[name]`` removes one.
- ``register_lazy(name, "package.module:attr")`` adds an entry whose module is imported the first
  time the entry is looked up, so a command or backend with an optional dependency costs nothing
  until it is used (and a missing dependency only hurts that entry).
- ``registry[name]`` / ``registry.get(name)`` returns the entry; an unknown name raises
  :class:`UnknownNameError` (a ``ValueError`` and a ``KeyError``) naming the kind, the name asked
  for and every registered name, sorted; a name that is not a ``str`` raises ``TypeError``.
  ``get(name, default)`` returns ``default`` for an unknown name instead, like ``dict.get``.
- ``create(name, **options)`` calls the entry with ``options``; an option the entry's signature
  does not take raises ``TypeError`` naming the entry, the options given and the ones it accepts.
  Errors raised by the entry itself (a bad option value) pass through unchanged.
- ``check(name)`` validates a name (same errors as lookup) without importing a lazy entry, for
  configs checked before anything is built. Iteration, ``names()`` and ``keys()`` follow
  registration order; ``in`` tests a name without importing a lazy entry; ``items()`` and
  ``values()`` resolve (import) every entry.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "UnknownNameError"]

_MISSING = object()


class UnknownNameError(ValueError, KeyError):
    """A name that is not registered; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class _Lazy:
    """``module:attr``, imported on first lookup."""

    target: str

    def resolve(self) -> object:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


class Registry(Generic[T]):
    """Name → implementation, for one ``kind`` of thing (used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | _Lazy] = {}

    def register(self, name: str, obj: T | None = None):
        """Add ``obj`` under ``name``; without ``obj``, a decorator that registers what it decorates."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty str, got {name!r}")

        def add(o: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = o
            return o

        if obj is None:
            return add
        return add(obj)

    def register_lazy(self, name: str, target: str) -> None:
        """Add ``"package.module:attr"`` under ``name``; the module is imported on first lookup."""
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"lazy {self.kind} target must be 'module:attr', got {target!r}")
        self.register(name, _Lazy(target))  # type: ignore[arg-type]

    def check(self, name: object) -> str:
        """``name`` if registered; TypeError for a non-str, UnknownNameError listing the names."""
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be str, got {type(name).__name__} {name!r}")
        if name not in self._entries:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}")
        return name

    def get(self, name: object, default: object = _MISSING) -> T:
        if default is not _MISSING and isinstance(name, str) and name not in self._entries:
            return default  # type: ignore[return-value]
        entry = self._entries[self.check(name)]
        if isinstance(entry, _Lazy):
            entry = self._entries[name] = entry.resolve()  # type: ignore[assignment]
        return entry  # type: ignore[return-value]

    def __getitem__(self, name: object) -> T:
        return self.get(name)

    def __setitem__(self, name: str, obj: T) -> None:
        self.register(name, obj)

    def __delitem__(self, name: str) -> None:
        del self._entries[self.check(name)]

    def create(self, name: object, **options) -> object:
        """``self[name](**options)``; an option the entry does not take raises TypeError naming it."""
        factory: Callable = self.get(name)  # type: ignore[assignment]
        accepted = _accepted_options(factory)
        if accepted is not None:
            unknown = sorted(set(options) - set(accepted))
            if unknown:
                raise TypeError(f"{self.kind} {name!r} rejected options {sorted(options)}: it takes no option(s) "
                                f"{unknown}; it accepts {accepted}")
        return factory(**options)

    def names(self) -> list[str]:
        return list(self._entries)

    keys = names

    def items(self) -> list[tuple[str, T]]:
        return [(name, self.get(name)) for name in self._entries]

    def values(self) -> list[T]:
        return [self.get(name) for name in self._entries]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _accepted_options(factory: Callable) -> list[str] | None:
    """Keyword names ``factory`` accepts, or None when it takes ``**kwargs`` or has no signature."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
