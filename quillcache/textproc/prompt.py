"""The prompt tokens of an OpenAI request body, computed the same way by the stand-in engine and the gateway.

- ``/v1/completions``: ``prompt`` is a string (encoded WITH special tokens, as vLLM does), a list of token ids
  (used as given, each checked against the vocabulary), or a one-element list of either. Batched prompts (several
  strings) are refused: neither side of QuillCache serves them.
- ``/v1/chat/completions``: ``messages`` rendered by the chat template (generation prompt added), encoded WITHOUT
  special tokens (the template holds them), as vLLM does.

Every refusal is a :class:`PromptError` (``ValueError``) whose message names the field.

:func:`prompt_token_array` gives the same ids as :func:`prompt_tokens` (same checks, same refusals) as one
``uint32`` array, without a Python int per token: the gateway's per-request path hashes it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from quillcache.textproc.chat import ChatFormatError, ChatTemplate
from quillcache.textproc.tokenizer import Tokenizer, TokenizerError

__all__ = ["PromptError", "PromptTokens", "chat_prompt_tokens", "completion_prompt_tokens", "prompt_token_array",
           "prompt_tokens"]

PromptKind = Literal["completion", "chat"]


class PromptError(ValueError):
    """A request body whose prompt cannot be turned into tokens (the message names the field)."""


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """``token_ids`` of a request's prompt; ``text`` is the rendered text (None when ids were given)."""

    kind: PromptKind
    token_ids: tuple[int, ...]
    text: str | None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _ids(value: list[Any], tokenizer: Tokenizer, field: str) -> tuple[int, ...]:
    vocab = tokenizer.vocab_size
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
            raise PromptError(f"{field}[{i}]={v!r:.40} is not a token id in [0, {vocab})")
    return tuple(value)


def _encode(tokenizer: Tokenizer, text: str, special: bool, as_array: bool):
    if as_array:
        enc = getattr(tokenizer, "encode_array", None)
        if enc is not None:
            return enc(text, add_special_tokens=special)
        return np.asarray(tokenizer.encode(text, add_special_tokens=special), dtype=np.uint32)
    return tuple(tokenizer.encode(text, add_special_tokens=special))


def completion_prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> PromptTokens:
    ids, text = _completion(body, tokenizer, False)
    return PromptTokens("completion", ids, text)


def _completion(body: dict[str, Any], tokenizer: Tokenizer, as_array: bool):
    if not isinstance(body, dict):
        raise PromptError(f"request body must be a JSON object, got {type(body).__name__}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = _encode(tokenizer, prompt, True, as_array)
        except (TokenizerError, TypeError) as e:
            raise PromptError(f"'prompt' cannot be tokenized: {e}") from None
        if not len(ids):
            raise PromptError("'prompt' is empty")
        return ids, prompt
    if isinstance(prompt, list):
        if not prompt:
            raise PromptError("'prompt' is an empty list")
        if all(isinstance(p, str) for p in prompt):
            raise PromptError(f"'prompt' holds {len(prompt)} strings; batched prompts are not supported")
        ids = _ids(prompt, tokenizer, "prompt")
        return (np.asarray(ids, dtype=np.uint32) if as_array else ids), None
    if prompt is None:
        raise PromptError("'prompt' is missing")
    raise PromptError(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}")


def chat_prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate) -> PromptTokens:
    ids, text = _chat(body, tokenizer, template, False)
    return PromptTokens("chat", ids, text)


def _chat(body: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate, as_array: bool):
    if not isinstance(body, dict):
        raise PromptError(f"request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise PromptError("'messages' is missing")
    try:
        text = template.render(body["messages"], add_generation_prompt=True)
    except ChatFormatError as e:
        raise PromptError(str(e)) from None
    try:
        ids = _encode(tokenizer, text, False, as_array)
    except TokenizerError as e:  # positions are in the rendered text
        raise PromptError(f"'messages' cannot be tokenized (rendered by the chat template): {e}") from None
    if not len(ids):
        raise PromptError("'messages' render to an empty prompt")
    return ids, text


def prompt_tokens(kind: PromptKind, body: dict[str, Any], tokenizer: Tokenizer,
                  template: ChatTemplate) -> PromptTokens:
    """Dispatch on the endpoint kind (``"completion"`` or ``"chat"``)."""
    if kind == "completion":
        return completion_prompt_tokens(body, tokenizer)
    if kind == "chat":
        return chat_prompt_tokens(body, tokenizer, template)
    raise ValueError(f"unknown prompt kind {kind!r}; known: ['chat', 'completion']")


def prompt_token_array(kind: PromptKind, body: dict[str, Any], tokenizer: Tokenizer,
                       template: ChatTemplate) -> np.ndarray:
    """``prompt_tokens(kind, ...).token_ids`` as a ``uint32`` array (module doc); the same refusals."""
    if kind == "completion":
        return _completion(body, tokenizer, True)[0]
    if kind == "chat":
        return _chat(body, tokenizer, template, True)[0]
    raise ValueError(f"unknown prompt kind {kind!r}; known: ['chat', 'completion']")
