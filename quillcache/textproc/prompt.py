"""The prompt tokens of an OpenAI request body, computed the same way by the stand-in engine and the gateway.

- ``/v1/completions``: ``prompt`` is a string (encoded WITH special tokens, as vLLM does), a list of token ids
  (used as given, each checked against the vocabulary), or a one-element list of either. Batched prompts (several
  strings) are refused: neither side of QuillCache serves them.
- ``/v1/chat/completions``: ``messages`` rendered by the chat template (generation prompt added), encoded WITHOUT
  special tokens (the template holds them), as vLLM does.

Every refusal is a :class:`PromptError` (``ValueError``) whose message names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from quillcache.textproc.chat import ChatFormatError, ChatTemplate
from quillcache.textproc.tokenizer import Tokenizer, TokenizerError

__all__ = ["PromptError", "PromptTokens", "chat_prompt_tokens", "completion_prompt_tokens", "prompt_tokens"]

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


def completion_prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> PromptTokens:
    if not isinstance(body, dict):
        raise PromptError(f"request body must be a JSON object, got {type(body).__name__}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        except (TokenizerError, TypeError) as e:
            raise PromptError(f"'prompt' cannot be tokenized: {e}") from None
        if not ids:
            raise PromptError("'prompt' is empty")
        return PromptTokens("completion", tuple(ids), prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise PromptError("'prompt' is an empty list")
        if all(isinstance(p, str) for p in prompt):
            raise PromptError(f"'prompt' holds {len(prompt)} strings; batched prompts are not supported")
        return PromptTokens("completion", _ids(prompt, tokenizer, "prompt"), None)
    if prompt is None:
        raise PromptError("'prompt' is missing")
    raise PromptError(f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}")


def chat_prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate) -> PromptTokens:
    if not isinstance(body, dict):
        raise PromptError(f"request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise PromptError("'messages' is missing")
    try:
        text = template.render(body["messages"], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
    except (ChatFormatError, TokenizerError) as e:
        raise PromptError(str(e)) from None
    if not ids:
        raise PromptError("'messages' render to an empty prompt")
    return PromptTokens("chat", tuple(ids), text)


def prompt_tokens(kind: PromptKind, body: dict[str, Any], tokenizer: Tokenizer,
                  template: ChatTemplate) -> PromptTokens:
    """Dispatch on the endpoint kind (``"completion"`` or ``"chat"``)."""
    if kind == "completion":
        return completion_prompt_tokens(body, tokenizer)
    if kind == "chat":
        return chat_prompt_tokens(body, tokenizer, template)
    raise ValueError(f"unknown prompt kind {kind!r}; known: ['chat', 'completion']")
