"""The ``tcp`` backend: a ``TcpServer`` serving this engine's regions plus a ``TcpClient`` reaching peers.

See ``protocol`` for the wire format, ``tcp_server`` and ``tcp_client`` for each side's invariants.
The shared secret must be the same on every peer of a cluster; it is never sent. ``host`` must be a
non-empty str (``"0.0.0.0"`` serves every interface; ``""`` is refused, not read as "all") and ``port`` an
int in 0..65535 (0: the kernel picks one); anything else raises naming the option.
"""

from __future__ import annotations

from quillcache._checks import check_int
from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.backends.tcp_client import TcpClient
from quillcache.transfer.backends.tcp_server import TcpServer
from quillcache.transfer.batch import Item
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import RemoteRegion

__all__ = ["MIN_SECRET_BYTES", "TcpBackend", "TcpConfig", "check_host"]

MIN_SECRET_BYTES = 16


def _secret_bytes(secret: object) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be str or bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def check_host(name: str, host: object) -> str:
    """``host`` as the address to serve on: a non-empty str; ``ValueError``/``TypeError`` naming ``name``."""
    if not isinstance(host, str):
        raise TypeError(f"{name} must be a str (an address or host name), got {type(host).__name__} {host!r}")
    if not host.strip():
        raise ValueError(f"{name} must be a non-empty address or host name (\"0.0.0.0\" serves every interface), "
                         f"got {host!r}")
    return host


class TcpBackend:
    name = "tcp"

    def __init__(self, *, secret: str | bytes, host: str = "127.0.0.1", port: int = 0,
                 config: TcpConfig | None = None, serve: bool = True) -> None:
        self.secret = _secret_bytes(secret)
        self.config = config if config is not None else TcpConfig()
        if not isinstance(self.config, TcpConfig):
            raise TypeError(f"config must be a TcpConfig, got {type(self.config).__name__}")
        self.host, self.port = check_host("host", host), check_int("port", port, 0, 65535)
        self.serve = serve
        self.server: TcpServer | None = None
        self.client = TcpClient(self.secret, self.config)
        self.transfer_one = self.client.transfer_one  # the engine's lean synchronous path

    @property
    def fixed_address(self) -> bool:
        """Whether this backend serves at a port its caller chose, where a later process may serve next (the
        engine then starts its region ids at a random value)."""
        return self.serve and self.port != 0

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
