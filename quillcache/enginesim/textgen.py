"""Deterministic output of the stand-in engine: seeded words, tokenized by the shared tokenizer.

A request's output is a sequence of words from :data:`WORDS`, drawn by ``random.Random(seed)`` with ``seed =
sha256(engine seed, request seed, prompt token ids)``: the same prompt (and ``seed`` field) always gives the same
text. The text is tokenized with the engine's tokenizer and cut to ``max_tokens`` ids; each decode step emits one
id and its text delta (:func:`incremental_deltas`, incremental detokenization as engines do it, linear in the
number of ids), so ``completion_tokens`` counts real tokenizer ids.

The engine needs a tokenizer that encodes every word of :data:`WORDS` to at least one id
(:func:`check_output_tokenizer`, run when the engine loads it): one whose vocabulary lacks them and has no unknown
token encodes them to nothing, and no output could be planned (:func:`plan_output` raises ``TokenizerError``).
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from quillcache.textproc.tokenizer import Tokenizer, TokenizerError

__all__ = ["WORDS", "OutputPlan", "check_output_tokenizer", "incremental_deltas", "plan_output"]

WORDS = ("the", "cache", "block", "token", "prefix", "engine", "router", "quill", "memory", "tenant", "model",
         "stream", "reuse", "layer", "batch", "query", "value", "key", "scope", "tier", "fast", "safe", "exact",
         "chain", "hash", "event", "worker", "gateway", "latency", "prefill", "decode")


class OutputPlan:
    """Token ids and per-step text deltas of one request's output."""

    __slots__ = ("token_ids", "deltas")

    def __init__(self, token_ids: list[int], deltas: list[str]) -> None:
        assert len(token_ids) == len(deltas)
        self.token_ids = token_ids
        self.deltas = deltas

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def check_output_tokenizer(tokenizer: Tokenizer) -> None:
    """Refuse (``TokenizerError`` naming the word) a tokenizer that encodes a word of :data:`WORDS` to no id."""
    for word in WORDS:
        if not tokenizer.encode(" " + word):
            raise TokenizerError(
                f"tokenizer {tokenizer.name!r} encodes the stand-in engine's output word {word!r} to no token id "
                f"(its vocabulary lacks it and has no unknown token); engine-sim needs a tokenizer that covers "
                f"plain English words")


def plan_output(tokenizer: Tokenizer, prompt_ids: Sequence[int], max_tokens: int, *, engine_seed: int,
                request_seed: int | None) -> OutputPlan:
    """The output for a prompt; ``TokenizerError`` if the tokenizer encodes more words to no more ids (see
    :func:`check_output_tokenizer`), never an endless loop."""
    h = hashlib.sha256(f"{engine_seed}:{request_seed}:".encode() + bytes(str(list(prompt_ids)), "ascii")).digest()
    rng = random.Random(int.from_bytes(h[:8], "little"))
    ids: list[int] = []
    words: list[str] = []
    while len(ids) < max_tokens:  # each round adds words, and so ids (else it raises): this ends
        words.extend(rng.choice(WORDS) for _ in range(max(8, max_tokens - len(ids))))
        more = tokenizer.encode(" " + " ".join(words))
        if len(more) <= len(ids):
            raise TokenizerError(f"tokenizer {tokenizer.name!r} encodes the stand-in engine's output words to no "
                                 f"more token ids ({len(more)} for {len(words)} words)")
        ids = more
    ids = ids[:max_tokens]
    return OutputPlan(ids, incremental_deltas(tokenizer, ids))


def incremental_deltas(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """One text delta per id, by incremental detokenization in O(len(ids)) decodes (vLLM's prefix/read offsets):
    text is released once it no longer ends in an incomplete character (U+FFFD); the last delta flushes the rest,
    so ``"".join(deltas)`` is the decoded text of all ids."""
    deltas: list[str] = []
    prefix_offset = read_offset = 0
    for k in range(1, len(ids) + 1):
        prefix_text = tokenizer.decode(ids[prefix_offset:read_offset])
        new_text = tokenizer.decode(ids[prefix_offset:k])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            deltas.append(new_text[len(prefix_text):])
            prefix_offset, read_offset = read_offset, k
        else:
            deltas.append("")
    if deltas and read_offset < len(ids):
        rest = tokenizer.decode(ids[prefix_offset:])
        deltas[-1] += rest[len(tokenizer.decode(ids[prefix_offset:read_offset])):]
    return deltas
