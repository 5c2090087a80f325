"""Lookahead-W LRU: a SEMI-ONLINE policy that sees the requests already queued at the engine.

Not an online policy, and never reported beside online ones: an engine that holds W requests in
its queue knows which blocks those requests will reference (AttentionStore, ATC '24, uses such a
lookahead to place KV ahead of use). This policy uses exactly that and nothing further ahead:

- it keeps LRU order (``insert``/``touch`` move a key to the most recent end);
- ``victim``: the least recent key that no queued request references (neither the rest of the
  request being served nor the next ``window_requests`` requests); if every tracked key is
  referenced in the window, the one whose next reference in the window comes last.

It takes two oracles from whoever replays the trace (``quillcache.hitrate.reference`` builds
them): ``next_use_oracle(key)`` - the position of the next reference to the key referenced now
(as for Belady) - and ``window_end_oracle()`` - the position where the window ends (the first
reference of the request ``window_requests + 1`` after the current one). A next use at or past
the window end is only ever compared with the window end, so nothing beyond the window leaks in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from quillcache._checks import check_int
from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class LookaheadPolicy(EvictionPolicy):
    name = "lookahead"
    semi_online = True  # sees the queued requests: reported apart from online policies

    def __init__(self, *, next_use_oracle: Callable[[Key], int] | None = None,
                 window_end_oracle: Callable[[], int] | None = None, window_requests: int = 8) -> None:
        super().__init__()
        if not callable(next_use_oracle) or not callable(window_end_oracle):
            raise TypeError("lookahead sees the queued requests: pass next_use_oracle=callable(key) -> position and "
                            "window_end_oracle=callable() -> position (quillcache.hitrate.reference builds them), got "
                            f"{next_use_oracle!r}, {window_end_oracle!r}")
        self.window_requests = check_int("window_requests", window_requests, 0)
        self._next_use = next_use_oracle
        self._window_end = window_end_oracle
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._next: dict[Key, int] = {}

    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        self._order[key] = None
        self._next[key] = int(self._next_use(key))

    def touch(self, key: Key) -> None:
        self._require(key)
        self._order.move_to_end(key)
        self._next[key] = int(self._next_use(key))

    def remove(self, key: Key) -> None:
        self._drop(key)
        del self._order[key]
        del self._next[key]

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        end = int(self._window_end())
        best, best_nu = None, -1
        for key in self._order:
            if not is_evictable(key):
                continue
            nu = self._next[key]
            if nu >= end:
                return key
            if nu > best_nu:
                best, best_nu = key, nu
        return best
