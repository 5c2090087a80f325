"""Authentication of the calls that change a pool node's state (``persist``, ``flush``) on its control port.

The control port is a plain RPC server (no handshake), beside the transfer port, which authenticates every
connection on the cluster's shared secret. Its state-changing calls carry a proof on the same secret:

- ``control_key(secret)`` = HMAC-SHA256(secret, ``CONTROL_KEY_LABEL``): the key both sides derive (the transfer
  secret itself never signs anything here, so a control proof is no transfer proof);
- ``sign(key, method, args)`` -> ``[ts_ms, mac]``, ``mac`` = HMAC-SHA256(key, msgpack([method, ts_ms, args]))
  (tuples pack as arrays, so what the node decodes packs to the same bytes);
- ``check(key, method, args, auth)``: None when ``auth`` is a proof of ``method`` on these ``args`` made within
  ``MAX_SKEW_S`` of now, else why not (the node refuses the call with ``ControlAuthError``, before it looks at
  the arguments). Digests are compared in constant time.

A node without a secret (the in-process ``local`` backend, which has no transfer port either) checks nothing.
Within ``MAX_SKEW_S`` a captured call can be replayed: ``persist`` of verified objects and ``flush`` are
idempotent, and a replay is bounded like any call (``quillcache.pool.writebehind``). ``info`` (read-only) needs
no proof. Clocks of the store's and the node's hosts must agree to within ``MAX_SKEW_S``.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import msgpack

from quillcache.pool.errors import ControlAuthError

__all__ = ["CONTROL_KEY_LABEL", "ControlAuthError", "MAX_SKEW_S", "check", "control_key", "sign"]

CONTROL_KEY_LABEL = b"quillcache-pool-control-v1"
MAX_SKEW_S = 60.0  # how far a proof's timestamp may be from the node's clock
_MAC_BYTES = 32


def control_key(secret: str | bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the pool secret is empty")
    return hmac.new(raw, CONTROL_KEY_LABEL, hashlib.sha256).digest()


def _plain(obj: object) -> int:
    """msgpack's fallback: an integer type of another library (NumPy) packs as the int the RPC codec sends."""
    if hasattr(obj, "__index__"):
        return obj.__index__()
    raise TypeError(f"cannot sign a {type(obj).__name__}")


def _mac(key: bytes, method: str, ts_ms: int, args: object) -> bytes:
    packed = msgpack.packb([method, ts_ms, args], use_bin_type=True, default=_plain)
    return hmac.new(key, packed, hashlib.sha256).digest()


def sign(key: bytes, method: str, args: object, *, now_s: float | None = None) -> list:
    ts_ms = int((time.time() if now_s is None else now_s) * 1000)
    return [ts_ms, _mac(key, method, ts_ms, args)]


def check(key: bytes, method: str, args: object, auth: object, *, now_s: float | None = None) -> str | None:
    if auth is None:
        return f"{method} needs a proof on the pool secret (the caller sent none: a store of an older version, or one " \
               f"without the cluster's secret)"
    if not (isinstance(auth, (list, tuple)) and len(auth) == 2 and type(auth[0]) is int
            and isinstance(auth[1], bytes) and len(auth[1]) == _MAC_BYTES):
        return f"{method}: malformed proof (expected [timestamp ms, {_MAC_BYTES}-byte HMAC])"
    ts_ms, mac = auth
    now_ms = (time.time() if now_s is None else now_s) * 1000
    if abs(now_ms - ts_ms) > MAX_SKEW_S * 1000:
        return (f"{method}: proof made {abs(now_ms - ts_ms) / 1000:.0f} s from this node's clock (at most "
                f"{MAX_SKEW_S:g} s: a replay, or clocks that disagree)")
    try:
        want = _mac(key, method, ts_ms, args)
    except (TypeError, ValueError, OverflowError) as e:
        return f"{method}: arguments that cannot be signed ({e})"
    if not hmac.compare_digest(want, mac):
        return f"{method}: the proof does not match (another secret, or arguments changed on the way)"
    return None
