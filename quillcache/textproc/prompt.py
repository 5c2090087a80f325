"""The prompt tokens of an OpenAI request body, computed the same way by the stand-in engine and the gateway.

- ``/v1/completions``: ``prompt`` is a string (encoded WITH special tokens unless the request's
  ``add_special_tokens`` is false, as vLLM does), a list of token ids
  (used as given, each checked against the vocabulary), or a one-element list of either. Batched prompts (several
  strings) are refused: neither side of QuillCache serves them.
- ``/v1/chat/completions``: ``messages`` rendered by the chat template, encoded WITHOUT special tokens (the template
  holds them) unless the request's ``add_special_tokens`` is true, as vLLM does. The request's fields reach the template as vLLM's chat endpoint passes them
  (:func:`chat_render_args`; a null field counts as absent): ``add_generation_prompt`` (default true),
  ``continue_final_message`` (default false; not together with ``add_generation_prompt``), ``tools`` (each shaped
  as vLLM's request model dumps it, other keys dropped:
  ``{"type", "function": {"name", "description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}``),
  ``documents``, ``reasoning_effort`` (which also sets ``enable_thinking`` unless ``chat_template_kwargs`` names
  it) and ``chat_template_kwargs``. Precedence, lowest first: ``tools``; then ``chat_template_kwargs`` (its
  ``tools`` replace the request's; a value null or ``"auto"`` counts as absent); then the request's
  ``add_generation_prompt``, ``continue_final_message``, ``documents`` and ``reasoning_effort``. Keys of
  ``chat_template_kwargs`` that ``transformers`` consumes itself (``tokenize``, ``padding``, ``return_dict``, ...)
  never reach the template; ``messages`` / ``conversation`` there and a per-request ``chat_template`` are refused,
  as vLLM refuses them by default.

Every refusal is a :class:`PromptError` (``ValueError``) whose message names the field.

:func:`prompt_token_array` gives the same ids as :func:`prompt_tokens` (same checks, same refusals) as one
``uint32`` array, without a Python int per token: the gateway's per-request path hashes it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np

from quillcache.textproc.chat import ChatFormatError, ChatTemplate
from quillcache.textproc.tokenizer import Tokenizer, TokenizerError

__all__ = ["PromptError", "PromptTokens", "chat_prompt_tokens", "chat_render_args", "completion_prompt_tokens",
           "prompt_token_array", "prompt_tokens"]

PromptKind = Literal["completion", "chat"]

# apply_chat_template's own parameters: they never become template variables, so these kwargs change no text
_HF_CALL_PARAMS: Final = frozenset({"tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                    "return_assistant_tokens_mask", "tokenizer_kwargs", "add_generation_prompt",
                                    "continue_final_message"})
_UNSET: Final = (None, "auto")  # vLLM's merge_kwargs treats these values as not given


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
    special = _flag(body, "add_special_tokens", True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            ids = _encode(tokenizer, prompt, special, as_array)
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


# what vLLM's request model (pydantic, lax mode) reads as a boolean, besides true and false
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


def _flag(body: dict[str, Any], field: str, default: bool) -> bool:
    """A boolean request field as vLLM's request model (pydantic, lax mode) reads it: true/false, the numbers 1/0
    (1.0 and 0.0 too), or pydantic's strings ("true", "yes", "on", "1"... in any case, no surrounding space);
    anything else is refused naming the field."""
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_STRINGS | _FALSE_STRINGS:
        return value.lower() in _TRUE_STRINGS
    raise PromptError(f"'{field}' must be true or false, got {value!r:.40}")


def _objects(value: object, field: str, *, str_values: bool = False) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise PromptError(f"'{field}' must be a list of objects, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise PromptError(f"'{field}[{i}]' must be an object, got {type(item).__name__}")
        if str_values and not all(isinstance(v, str) for v in item.values()):
            raise PromptError(f"'{field}[{i}]' must map strings to strings")
    return value


def _optional(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if value is not None and not isinstance(value, kind):
        raise PromptError(f"'{where}.{key}' must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _request_tools(value: object) -> list[dict[str, Any]] | None:
    """The request's ``tools`` as vLLM's request model dumps them (module docstring)."""
    if value is None:
        return None
    tools = _objects(value, "tools")
    if not tools:
        raise PromptError("'tools' is an empty list; give at least one tool or leave it out")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise PromptError(f"'{where}.type' must be \"function\", got {tool.get('type')!r:.40}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise PromptError(f"'{where}.function' must be an object, got {type(fn).__name__}")
        if not isinstance(fn.get("name"), str):
            raise PromptError(f"'{where}.function.name' must be a string")
        shaped = {"name": fn["name"], "description": _optional(fn, "description", str, f"{where}.function"),
                  "parameters": _optional(fn, "parameters", dict, f"{where}.function")}
        if (strict := _optional(fn, "strict", bool, f"{where}.function")) is not None:
            shaped["strict"] = strict
        tool_defer = _optional(tool, "defer_loading", bool, where)
        defer = _optional(fn, "defer_loading", bool, f"{where}.function")
        if (defer := tool_defer if defer is None else defer) is not None:
            shaped["defer_loading"] = defer
        dumped: dict[str, Any] = {"type": "function", "function": shaped}
        if tool_defer is not None:
            dumped["defer_loading"] = tool_defer
        out.append(dumped)
    return out


def chat_render_args(body: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :meth:`ChatTemplate.render` for a chat request body, resolved as vLLM resolves them
    (module docstring); every refusal is a :class:`PromptError` naming the field."""
    if body.get("chat_template") is not None:
        raise PromptError("'chat_template' per request is not supported: the gateway and the engine must render "
                          "with the served model's template")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    tools = _request_tools(body.get("tools"))
    documents = body.get("documents")
    if documents is not None:
        _objects(documents, "documents", str_values=True)
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise PromptError(f"'reasoning_effort' must be a string, got {type(effort).__name__}")
    given = body.get("chat_template_kwargs")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise PromptError(f"'chat_template_kwargs' must be an object, got {type(given).__name__}")
    for key in ("messages", "conversation", "chat_template"):
        if given.get(key) is not None:
            raise PromptError(f"'chat_template_kwargs.{key}' cannot be given: the renderer sets it")
    kwargs = dict(given)
    if documents is not None:  # the request's own fields override chat_template_kwargs when given
        kwargs["documents"] = documents
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in given:
            kwargs["enable_thinking"] = effort != "none"
    kwargs = {k: v for k, v in kwargs.items()
              if k not in _HF_CALL_PARAMS and not (v is None or (isinstance(v, str) and v in _UNSET))}
    if "tools" in kwargs:  # replaces the request's tools
        tools = _objects(kwargs.pop("tools"), "chat_template_kwargs.tools")
    if "documents" in kwargs:  # the request's (checked above) or else the kwargs' own
        documents = _objects(kwargs.pop("documents"), "chat_template_kwargs.documents")
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
            "tools": tools, "documents": documents, "template_kwargs": kwargs}


def _chat(body: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate, as_array: bool):
    if not isinstance(body, dict):
        raise PromptError(f"request body must be a JSON object, got {type(body).__name__}")
    if "messages" not in body:
        raise PromptError("'messages' is missing")
    args = chat_render_args(body)
    special = _flag(body, "add_special_tokens", False)
    try:
        text = template.render(body["messages"], **args)
    except ChatFormatError as e:
        raise PromptError(str(e)) from None
    try:
        ids = _encode(tokenizer, text, special, as_array)
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
