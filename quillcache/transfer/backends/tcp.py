"""The ``tcp`` backend: a ``TcpServer`` serving this engine's regions plus a ``TcpClient`` reaching peers.

See ``protocol`` for the wire format, ``tcp_server`` and ``tcp_client`` for each side's invariants.
The shared secret must be the same on every peer of a cluster; it is never sent.
"""

from __future__ import annotations

from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.backends.tcp_client import TcpClient
from quillcache.transfer.backends.tcp_server import TcpServer
from quillcache.transfer.batch import Item
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import RemoteRegion

__all__ = ["MIN_SECRET_BYTES", "TcpBackend", "TcpConfig"]

MIN_SECRET_BYTES = 16


def _secret_bytes(secret: object) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be str or bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


class TcpBackend:
    name = "tcp"

    def __init__(self, *, secret: str | bytes, host: str = "127.0.0.1", port: int = 0,
                 config: TcpConfig | None = None, serve: bool = True) -> None:
        self.secret = _secret_bytes(secret)
        self.config = config if config is not None else TcpConfig()
        if not isinstance(self.config, TcpConfig):
            raise TypeError(f"config must be a TcpConfig, got {type(self.config).__name__}")
        self.host, self.port, self.serve = host, port, serve
        self.server: TcpServer | None = None
        self.client = TcpClient(self.secret, self.config)
        self.transfer_one = self.client.transfer_one  # the engine's lean synchronous path

    def start(self, regions: RegionTable) -> str:
        if not self.serve:
            return ""
        self.server = TcpServer(regions, self.secret, self.config, self.host, self.port)
        return self.server.address

    def open_segment(self, address: str, timeout_s: float) -> tuple[RemoteRegion, ...]:
        return self.client.list_regions(address, timeout_s)

    def lanes(self, address: str) -> int:
        return self.config.connections_per_peer

    def execute(self, address: str, items: list[Item]) -> None:
        self.client.execute(address, items)

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.close()
