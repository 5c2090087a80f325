"""Identity: who may reuse which cached blocks (public API).

``scope.py`` holds identity validation, the sharing policy (registered public prompts), reuse
verdicts and ``audit_reuse``; ``naive_cache.py`` is the naive content-hash cache the guard is
measured against (the LMCache/SGLang-style baseline).
"""

from quillcache.identity.scope import (
    DIGEST_BYTES,
    PUBLIC_TENANT,
    IdentityRegistry,
    RequestScope,
    ReuseReason,
    ReuseVerdict,
    SharingPolicy,
    audit_reuse,
    make_identity,
    public_identity,
    reuse_reason,
    validate_identity,
    validate_salt,
    validate_tenant_id,
)
from quillcache.identity.naive_cache import (
    NaiveContentCache,
)

__all__ = [
    "DIGEST_BYTES",
    "IdentityRegistry",
    "NaiveContentCache",
    "PUBLIC_TENANT",
    "RequestScope",
    "ReuseReason",
    "ReuseVerdict",
    "SharingPolicy",
    "audit_reuse",
    "make_identity",
    "public_identity",
    "reuse_reason",
    "validate_identity",
    "validate_salt",
    "validate_tenant_id",
]
