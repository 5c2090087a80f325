"""What the project's HTTP servers (the gateway, the STAND-IN engine) share: uvicorn's httptools
protocol under limits on what one client may hold (``guard``)."""

from quillcache.httpserve.guard import DEFAULT_GUARD, HttpGuard, guarded_protocol

__all__ = ["DEFAULT_GUARD", "HttpGuard", "guarded_protocol"]
