"""``quillcache engine-sim``: serve a STAND-IN engine (OpenAI-compatible, engine-model timing, real block cache,
vLLM KV events). It is not a GPU engine: see :mod:`quillcache.enginesim`.

``quillcache engine-sim --port P [--model NAME] [--block-size 16] [--gpu-blocks N] [--kv-events tcp://127.0.0.1:PORT]
[--kv-events-replay tcp://...] ...`` prints one JSON line with its address when serving (like ``quillcache
master``); logs go to stderr; SIGTERM stops it.
"""

from __future__ import annotations

import argparse

from quillcache.cli.argtypes import MAX_COUNT

DESCRIPTION = ("A STAND-IN engine, not a GPU engine: OpenAI-compatible /v1/completions and /v1/chat/completions "
               "(streaming), a hash-chained LRU block cache whose TTFT grows with uncached tokens through the "
               "engine model, vLLM-format KV events over ZeroMQ, vllm:* metrics and fault knobs.")


def _num(kind, lo: float, hi: float | None = None):
    """A converter for a number in ``[lo, hi]``; an integer flag without ``hi`` stops at ``MAX_COUNT`` (a
    larger one overflowed a C size: ``--kv-events-buffer-steps 10**21`` was an OverflowError naming no flag)."""
    if hi is None and kind is int:
        hi = MAX_COUNT

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'number' if kind is float else 'integer'}") from None
        if not (value >= lo and (hi is None or value <= hi)) or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} must be in [{lo}, {'inf' if hi is None else hi}]")
        return value
    return parse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_num(int, 0, 65535), default=0, help="port (default 0: a free one)")
    parser.add_argument("--model", default="quillcache-sim", help="served model name (default quillcache-sim)")
    parser.add_argument("--lora", action="append", default=[], metavar="NAME",
                        help="a LoRA adapter name requests may give as 'model' (repeatable)")
    parser.add_argument("--tokenizer", default=None, help="'bytes' (default, the test fallback) or a tokenizer.json")
    parser.add_argument("--chat-template", default=None,
                        help="'chatml' (default) or a tokenizer_config.json with a chat_template")
    parser.add_argument("--chat-template-content-format", choices=["auto", "string", "openai"], default="auto",
                        help="messages' content as the template gets it: one string or a list of parts "
                             "(default auto: detected from the template, as vLLM does)")
    g = parser.add_argument_group("engine model (the stand-in's timing and capacity)")
    g.add_argument("--engine-model", default="llama-3-8b", help="model profile for timing (default llama-3-8b)")
    g.add_argument("--gpu", default="h100-sxm", help="GPU profile (default h100-sxm)")
    g.add_argument("--block-size", type=_num(int, 1, 65536), default=16, help="tokens per KV block (default 16)")
    g.add_argument("--gpu-blocks", type=_num(int, 1), default=None,
                   help="prefix-cache capacity in blocks (default: the engine model's GPU capacity)")
    g.add_argument("--max-model-len", type=_num(int, 1), default=32768, help="prompt + output limit (default 32768)")
    g.add_argument("--max-num-seqs", type=_num(int, 1), default=256, help="running batch limit (default 256)")
    g.add_argument("--prefill-concurrency", type=_num(int, 0), default=1,
                   help="prefills at a time (default 1; 0 = no limit)")
    g.add_argument("--ttft-scale", type=_num(float, 0.0), default=1.0, help="multiplies the prefill time (default 1)")
    g.add_argument("--fixed-ttft-ms", type=_num(float, 0.0), default=None, help="a fixed TTFT instead of the model's")
    g.add_argument("--decode-ms-per-token", type=_num(float, 0.0), default=None,
                   help="a fixed inter-token time instead of the model's decode step")
    g.add_argument("--default-max-tokens", type=_num(int, 1), default=16, help="max_tokens when a request omits it")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated text (default 0)")
    f = parser.add_argument_group("fault knobs (seeded by --fault-seed)")
    f.add_argument("--error-rate", type=_num(float, 0.0, 1.0), default=0.0,
                   help="share of requests answered 500 (default 0)")
    f.add_argument("--hang-before-headers-s", type=_num(float, 0.0), default=0.0,
                   help="sleep this long before sending response headers")
    f.add_argument("--hang-rate", type=_num(float, 0.0, 1.0), default=1.0,
                   help="share of requests that hang, when --hang-before-headers-s is set (default 1: all)")
    f.add_argument("--die-mid-stream-after-tokens", type=_num(int, 0), default=None,
                   help="drop the connection of a stream after this many tokens")
    f.add_argument("--die-rate", type=_num(float, 0.0, 1.0), default=1.0,
                   help="share of streams that die, when --die-mid-stream-after-tokens is set (default 1: all)")
    f.add_argument("--fault-seed", type=int, default=0, help="seed of the fault draws (default 0)")
    k = parser.add_argument_group("KV events (vLLM wire format over ZeroMQ)")
    k.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="bind a PUB socket here (port 0: a free one; the JSON line says which)")
    k.add_argument("--kv-events-replay", default=None, metavar="tcp://HOST:PORT", help="bind the ROUTER replay socket")
    k.add_argument("--kv-events-topic", default="", help="topic frame (default empty)")
    k.add_argument("--kv-events-encoding", choices=["tagged", "positional"], default="tagged",
                   help="tagged maps (current vLLM, default) or positional arrays (older vLLM)")
    k.add_argument("--hash-signedness", choices=["u64", "i64", "bytes"], default="u64",
                   help="block hashes on the wire as u64, i64 or 32 digest bytes (default u64)")
    k.add_argument("--kv-events-buffer-steps", type=_num(int, 1), default=10_000, help="replay buffer (batches)")
    k.add_argument("--kv-events-drop-rate", type=_num(float, 0.0, 0.999), default=0.0,
                   help="fault knob: share of batches lost on the PUB socket (still replayable)")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="stderr log level (default warning)")


def run(args: argparse.Namespace) -> int:
    import sys

    from quillcache.enginesim.config import EngineSimConfig

    try:
        config = EngineSimConfig(
            model=args.model, lora_adapters=tuple(args.lora), tokenizer=args.tokenizer, chat_template=args.chat_template,
            chat_template_content_format=args.chat_template_content_format,
            engine_model=args.engine_model, gpu=args.gpu, block_size=args.block_size, gpu_blocks=args.gpu_blocks,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            prefill_concurrency=args.prefill_concurrency, ttft_scale=args.ttft_scale, fixed_ttft_ms=args.fixed_ttft_ms,
            decode_ms_per_token=args.decode_ms_per_token, default_max_tokens=args.default_max_tokens, seed=args.seed,
            error_rate=args.error_rate, hang_before_headers_s=args.hang_before_headers_s, hang_rate=args.hang_rate,
            die_mid_stream_after_tokens=args.die_mid_stream_after_tokens, die_rate=args.die_rate,
            fault_seed=args.fault_seed, kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
            kv_events_topic=args.kv_events_topic, kv_events_encoding=args.kv_events_encoding,
            hash_signedness=args.hash_signedness, kv_events_buffer_steps=args.kv_events_buffer_steps,
            kv_events_drop_rate=args.kv_events_drop_rate)
        # load what can fail on user input before serving: tokenizer, template, engine model
        from quillcache.enginesim.textgen import check_output_tokenizer
        from quillcache.harness.engine_model import EngineModel
        from quillcache.textproc import load_chat_template, load_tokenizer
        from quillcache.types import KvLayout

        tokenizer = load_tokenizer(config.tokenizer)  # loaded once: the engine serves these
        check_output_tokenizer(tokenizer)  # it must encode the engine's output words
        chat_template = load_chat_template(config.chat_template, content_format=config.chat_template_content_format)
        em = EngineModel.from_names(config.engine_model, config.gpu, layout=KvLayout(block_size_tokens=config.block_size))
        if config.gpu_blocks is None:
            em.gpu_capacity_blocks  # noqa: B018 - raises ValueError when the weights do not fit
    except ValueError as e:
        print(f"quillcache engine-sim: {e}", file=sys.stderr)
        return 2
    from quillcache.enginesim.server import serve

    try:
        return serve(config, host=args.host, port=args.port, log_level=args.log_level, tokenizer=tokenizer,
                     chat_template=chat_template)
    except Exception as e:  # e.g. a KV-event endpoint that cannot bind
        print(f"quillcache engine-sim: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
