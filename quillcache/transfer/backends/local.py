"""The ``local`` backend: peers are engines of this same process, and a transfer is one memcpy.

It is the embedded default (everything in one process) and the reference the TCP and RDMA backends
are tested against. Addresses are ``local://<n>``; an engine is reachable from the moment it starts
until it closes. A remote range is checked against the peer's ``RegionTable`` exactly as a TCP
server checks it, so a bad range fails the same way on every backend.
"""

from __future__ import annotations

import itertools
import threading

from quillcache.transfer.batch import Item
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import Op, Outcome, RegionError, RemoteRegion, TransferError

__all__ = ["LocalBackend"]

_PEERS: dict[str, RegionTable] = {}
_LOCK = threading.Lock()
_IDS = itertools.count(1)


class LocalBackend:
    name = "local"

    def __init__(self) -> None:
        self._address: str | None = None

    def start(self, regions: RegionTable) -> str:
        address = f"local://{next(_IDS)}"
        with _LOCK:
            _PEERS[address] = regions
        self._address = address
        return address

    def _peer(self, address: str) -> RegionTable:
        with _LOCK:
            table = _PEERS.get(address)
        if table is None:
            raise TransferError(f"no local engine at {address!r} (closed, or never started in this process)")
        return table

    def open_segment(self, address: str, timeout_s: float) -> tuple[RemoteRegion, ...]:
        return tuple(self._peer(address).describe())

    def lanes(self, address: str) -> int:
        return 1

    def execute(self, address: str, items: list[Item]) -> None:
        for it in items:
            if it.remaining_s() <= 0:
                it.finish(Outcome.TIMEOUT, "deadline passed before the request started")
                continue
            req = it.request
            try:
                table = self._peer(address)
                remote = table.checkout(req.remote_region, req.remote_offset_bytes, req.length_bytes,
                                        write=req.op is Op.WRITE)
            except (RegionError, TransferError) as e:
                it.finish(Outcome.FAILED, str(e))
                continue
            try:
                if req.op is Op.READ:
                    it.local_view[:] = remote
                else:
                    remote[:] = it.local_view
            finally:
                table.release(req.remote_region)
            it.finish(Outcome.COMPLETED, transferred_bytes=req.length_bytes)

    def close(self) -> None:
        with _LOCK:
            if self._address is not None:
                _PEERS.pop(self._address, None)
        self._address = None
