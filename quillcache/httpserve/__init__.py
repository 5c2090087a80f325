"""What the project's HTTP servers (the gateway, the STAND-IN engine) share: uvicorn's httptools
protocol under limits on what one client may hold (``guard``), and strict JSON for request bodies
(``jsonbody``)."""

from quillcache.httpserve.guard import DEFAULT_GUARD, HttpGuard, guarded_protocol
from quillcache.httpserve.jsonbody import BodyError, loads_strict

__all__ = ["DEFAULT_GUARD", "BodyError", "HttpGuard", "guarded_protocol", "loads_strict"]
