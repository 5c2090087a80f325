"""``Registry``: named implementations of one kind (policies, routers, index backends, kernels, commands).

Contract:
- ``register(name, obj)`` (or ``@registry.register(name)``) adds an entry; registering a name twice
  raises ``ValueError`` (a second registration is a bug, not an override).
- ``registry[name]`` / ``registry.get(name)`` returns the entry; an unknown or non-string name raises
  :class:`UnknownNameError` (a ``ValueError`` and a ``KeyError``) naming the kind, the name asked
  for and every registered name, sorted.
- ``create(name, **options)`` calls the entry with ``options``; an option the entry does not take
  raises ``TypeError`` naming the entry and the options given.
- Iteration, ``names()`` and ``keys()`` follow registration order; ``in`` tests a name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "UnknownNameError"]


class UnknownNameError(ValueError, KeyError):
    """A name that is not registered; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name → implementation, for one ``kind`` of thing (used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

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

    def get(self, name: object) -> T:
        if not isinstance(name, str) or name not in self._entries:
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {sorted(self._entries)}")
        return self._entries[name]

    __getitem__ = get

    def create(self, name: object, **options) -> object:
        """``self[name](**options)``; a rejected option raises TypeError naming the entry."""
        factory: Callable = self.get(name)  # type: ignore[assignment]
        try:
            return factory(**options)
        except TypeError as exc:
            raise TypeError(f"{self.kind} {name!r} rejected options {sorted(options)}: {exc}") from None

    def names(self) -> list[str]:
        return list(self._entries)

    keys = names

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())

    def values(self) -> list[T]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
