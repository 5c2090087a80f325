"""``quillcache gateway``: the OpenAI-compatible streaming proxy with cache-aware, identity-guarded routing.

``quillcache gateway --engines URL[,URL...] [--config FILE] [--keys FILE] [--host 127.0.0.1] [--port 8000]``.
API keys come from ``--keys FILE`` (``{"keys": [{"key", "tenant", "max_concurrency"?}]}``) or the environment
(``QUILLCACHE_GATEWAY_KEYS=key=tenant,...``); ``QUILLCACHE_GATEWAY_SECRET`` keys the per-tenant cache salts (give
every replica the same one). Prints one JSON line ``{"address", "url", "pid", "engines", "models"}`` when serving;
SIGTERM stops it. Bad flags, config, key file, tokenizer or chat template: one line naming it, exit 2, before the
gateway listens. See :mod:`quillcache.gateway`.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from quillcache.cli import argtypes

if TYPE_CHECKING:
    from quillcache.textproc import ChatTemplate, Tokenizer


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", metavar="URL[,URL...]",
                        help="engine base URLs (replace the config file's engines; prefix state then approximate)")
    parser.add_argument("--config", metavar="FILE", help="JSON gateway config (engines, models, limits, timeouts...)")
    parser.add_argument("--keys", metavar="FILE",  # 8 = gateway.tenants.MIN_KEY_CHARS (importing it costs ~1.7 s)
                        help="JSON key file; default: QUILLCACHE_GATEWAY_KEYS=key=tenant[,key=tenant...] (a key: "
                             "at least 8 characters, no whitespace; a tenant: 1-128 characters from [A-Za-z0-9._@-])")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=argtypes.port, default=8000, help="port to listen on (default 8000; 0: a free one)")
    parser.add_argument("--tokenizer", help="'bytes' or a tokenizer.json path (the engines' tokenizer)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="stderr log level (default warning)")


def _load_text_files(args: argparse.Namespace, config) -> tuple[Tokenizer | None, ChatTemplate | None, str | None]:
    """(tokenizer, chat template, None) as the gateway will serve them, loaded once here so that a bad one is
    refused before serving, or (None, None, why) with a sentence naming the flag or config field."""
    from quillcache.textproc import load_chat_template, load_tokenizer

    try:
        tokenizer = load_tokenizer(config.tokenizer)
    except ValueError as exc:  # TokenizerError: no such file, not a tokenizer.json, no 'tokenizers' package
        where = "--tokenizer" if args.tokenizer is not None else f"config {args.config}: tokenizer"
        return None, None, f"{where}: {exc}"
    try:
        template = load_chat_template(config.chat_template, content_format=config.chat_template_content_format)
    except ValueError as exc:  # ChatFormatError
        return None, None, f"config {args.config}: chat_template: {exc}"
    return tokenizer, template, None


def run(args: argparse.Namespace) -> int:
    import logging
    import os
    import sys

    from quillcache.gateway.config import ConfigError, load_config, parse_engine_urls
    from quillcache.gateway.tenants import SECRET_ENV, TenantTable

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.engines and not args.config:
        print("quillcache gateway: give --engines URL[,URL...] or --config FILE", file=sys.stderr)
        return 2
    try:
        engines = parse_engine_urls(args.engines) if args.engines else ()
        config = load_config(args.config, engines=engines, tokenizer=args.tokenizer)
        tenants = TenantTable.from_file(args.keys) if args.keys else TenantTable.from_env()
    except ConfigError as exc:
        print(f"quillcache gateway: {exc}", file=sys.stderr)
        return 2
    tokenizer, template, problem = _load_text_files(args, config)
    if problem:
        print(f"quillcache gateway: {problem}", file=sys.stderr)
        return 2
    from quillcache.gateway.server import serve
    from quillcache.textproc import TokenizerError

    try:
        return serve(config, tenants, host=args.host, port=args.port,
                     secret=os.environ.get(SECRET_ENV, "").encode(), log_level=args.log_level,
                     tokenizer=tokenizer, template=template)
    except (TokenizerError, ValueError, OSError) as exc:
        print(f"quillcache gateway: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
