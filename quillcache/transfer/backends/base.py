"""What a transfer backend implements; the engine owns regions, batches, deadlines and threads.

Contract:
- ``start(regions)`` begins serving ``regions`` (a ``RegionTable``) to peers and returns this
  engine's address (what peers pass to ``open_segment``).
- ``open_segment(address, timeout_s)`` reaches the peer and returns the regions it serves.
- ``execute(address, items)`` moves the bytes of ``items`` (``batch.Item``) to/from the peer at
  ``address`` and finishes EVERY item with a terminal outcome before it returns, meeting each
  item's deadline (an item whose deadline passed ends TIMEOUT). It may be called from several
  threads at once; it never raises for a transfer failure (that is an item's outcome).
- ``lanes(address)`` is how many ``execute`` calls to one peer may usefully run at once.
- ``close()`` stops serving and frees every connection and thread; it is idempotent.
"""

from __future__ import annotations

from typing import Protocol

from quillcache.transfer.batch import Item
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import RemoteRegion

__all__ = ["Backend"]


class Backend(Protocol):
    name: str

    def start(self, regions: RegionTable) -> str: ...

    def open_segment(self, address: str, timeout_s: float) -> tuple[RemoteRegion, ...]: ...

    def execute(self, address: str, items: list[Item]) -> None: ...

    def lanes(self, address: str) -> int: ...

    def close(self) -> None: ...
