"""Traces: the Mooncake-format loader, record schemas, token synthesis and generated workloads.

``loader.py`` reads traces (skip-or-stop with line numbers) and synthesises tokens; ``schemas.py``
checks records; ``sessions.py`` and ``collision.py`` generate multi-turn and identity-collision
workloads, ``churn.py`` the residency churn (index put/remove stream) a trace induces on a pool,
all deterministically from a seed.
"""

from quillcache.traces.loader import (
    DEFAULT_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    SkippedLine,
    TraceError,
    TraceLoadReport,
    TraceRequest,
    default_trace_path,
    load_trace,
    load_trace_report,
    parse_line,
    synthesize_tokens,
)
from quillcache.traces.schemas import (
    SCHEMAS,
    SchemaError,
    check_record,
)

__all__ = [
    "DEFAULT_TRACE",
    "MOONCAKE_BLOCK_TOKENS",
    "SCHEMAS",
    "SchemaError",
    "SkippedLine",
    "TraceError",
    "TraceLoadReport",
    "TraceRequest",
    "check_record",
    "default_trace_path",
    "load_trace",
    "load_trace_report",
    "parse_line",
    "synthesize_tokens",
]
