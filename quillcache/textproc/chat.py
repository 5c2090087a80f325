"""Chat templates: OpenAI ``messages`` -> the prompt text that the engine and the gateway both tokenize.

Two templates, registered in :data:`CHAT_TEMPLATES`:

- ``"chatml"`` — :class:`ChatMLTemplate`, the one fixed, documented default (ChatML, as Qwen and many others use)::

      <|im_start|>{role}\\n{content}<|im_end|>\\n      (one per message, in order)
      <|im_start|>assistant\\n                         (when add_generation_prompt)

  It renders ``role`` and ``content`` only (like a plain ChatML Jinja template, it ignores tools and tool calls).

- ``"jinja"`` — :class:`JinjaChatTemplate`, a HuggingFace-style Jinja2 template (``chat_template`` of a model's
  ``tokenizer_config.json``), rendered in Jinja2's immutable sandbox like ``transformers``' ``apply_chat_template``
  does as vLLM calls it (``transformers``' ``{% generation %}`` block tag included): the variables are
  ``bos_token`` and ``eos_token``, then the template kwargs (which may override those two), then ``messages``,
  ``tools``, ``documents`` and ``add_generation_prompt``; plus ``raise_exception``.

Messages are validated first (:func:`normalize_messages`) and shaped as vLLM's ``parse_chat_messages`` gives them
to the template: a non-empty list of objects with a ``role`` in :data:`ROLES` and a ``content`` that is a string,
a list of ``{"type": "text", "text": str}`` parts, or null (only for ``assistant``). The template receives that
content in its content format (``quillcache.textproc.content_format``, detected from a Jinja template's source as
vLLM's ``auto`` does; ChatML is ``"string"``): one string (parts joined with ``"\\n"``, null as "") or a list of
text parts (a string as one part, null as no parts). Each normalized message is ``{"role", "content"}`` plus, when
given: ``tool_calls`` (assistant; each ``{"id", "function": {"arguments", "name"}, "type"}``, other keys dropped, with
``arguments`` read as vLLM reads it: a JSON string parsed, ``{}`` when it is not valid JSON, an object or a list
kept, anything else ``{}``; an empty list is dropped), ``reasoning`` and
``reasoning_content`` (assistant; the same string, from either field), ``tool_call_id`` (tool), ``name`` and
``task`` (any role), and ``tools`` (developer, null when absent). Other fields are not passed. The request's
objects are never modified. Anything malformed raises :class:`ChatFormatError` (a ``ValueError``) naming the
message index and the field.

``continue_final_message`` cuts the rendered text right after the final message's content as ``transformers`` (5)
does, so the model continues that message: the content (its last text part) is rendered with
:data:`CONTINUE_TAG` appended and the text is cut where the tag begins (and right-stripped there when the template
trimmed the space the tag ends with); a template that never mentions ``content`` is refused. It cannot be combined
with ``add_generation_prompt``. Rendering is
deterministic: the same arguments give the same text, byte for byte, so both sides of the gateway get the same
tokens; the one exception is a template that calls ``strftime_now`` (Llama 3.2/3.3 date their system prompt),
which renders the rendering process's local date as ``transformers`` does, so a gateway and an engine on either
side of midnight, or in different time zones, hash different first blocks.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from quillcache.registry import Registry
from quillcache.textproc.content_format import ContentFormat, resolve_content_format
from quillcache.textproc.jinja_env import jinja_environment_class

__all__ = [
    "CHAT_TEMPLATES",
    "ROLES",
    "ChatFormatError",
    "ChatMLTemplate",
    "ChatTemplate",
    "JinjaChatTemplate",
    "load_chat_template",
    "normalize_messages",
]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 10_000
# set by JinjaChatTemplate.render itself, never from template_kwargs
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"})


class ChatFormatError(ValueError):
    """Malformed ``messages`` or a template that cannot be loaded or rendered (the message says which)."""


def _text_parts(i: int, role: str, content: object) -> list[str]:
    """The texts of a message's content, in order: one for a string, one per part for a list of text parts."""
    if content is None:
        if role != "assistant":
            raise ChatFormatError(f"messages[{i}].content is missing (only an assistant message may omit it)")
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatFormatError(
                    f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": str}} "
                    f"(only text parts are supported)")
            parts.append(part["text"])
        return parts
    raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts, "
                          f"got {type(content).__name__}")


def _shaped_content(texts: list[str], content_format: ContentFormat) -> str | list[dict[str, str]]:
    """The content as the template receives it (``quillcache.textproc.content_format``)."""
    if content_format == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return "\n".join(t for t in texts if t)  # vLLM keeps a string part only when it is not empty


def _arguments(where: str, value: object) -> Any:
    """vLLM's reading of a tool call's ``arguments``: a JSON string is parsed (``{}`` when it is not valid JSON);
    an object or a list is kept; anything else becomes ``{}``."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return {}
        except RecursionError:
            raise ChatFormatError(f"{where}.arguments is nested too deeply to parse") from None
    return value if isinstance(value, (dict, list)) else {}


def _tool_calls(i: int, value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ChatFormatError(f"messages[{i}].tool_calls must be a list, got {type(value).__name__}")
    out = []
    for j, call in enumerate(value):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ChatFormatError(f"{where} must be an object, got {type(call).__name__}")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"{where}.function must be an object with a string 'name'")
        for key in ("id", "type"):
            if key in call and not isinstance(call[key], str):
                raise ChatFormatError(f"{where}.{key} must be a string, got {type(call[key]).__name__}")
        # the shape (and key order) vLLM's request model gives a tool call; other keys are not passed
        shaped: dict[str, Any] = {}
        if "id" in call:
            shaped["id"] = call["id"]
        shaped["function"] = {"arguments": _arguments(f"{where}.function", fn.get("arguments")), "name": fn["name"]}
        if "type" in call:
            shaped["type"] = call["type"]
        out.append(shaped)
    return out


def _optional_str(i: int, m: dict[str, Any], key: str) -> str | None:
    value = m.get(key)
    if value is not None and not isinstance(value, str):
        raise ChatFormatError(f"messages[{i}].{key} must be a string, got {type(value).__name__}")
    return value


def normalize_messages(messages: object, content_format: ContentFormat = "string") -> list[dict[str, Any]]:
    """Validated messages as vLLM hands them to a template of that content format: ``{"role", "content"}`` plus
    the fields the module docstring lists, ``content`` a string or a list of text parts. New objects throughout:
    the caller's ``messages`` are not modified."""
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai', got {content_format!r:.40}")
    if not isinstance(messages, list):
        raise ChatFormatError(f"'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatFormatError("'messages' is empty")
    if len(messages) > MAX_MESSAGES:
        raise ChatFormatError(f"'messages' has {len(messages)} entries, more than {MAX_MESSAGES}")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r:.40}")
        msg: dict[str, Any] = {"role": role,
                               "content": _shaped_content(_text_parts(i, role, m.get("content")), content_format)}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                calls = _tool_calls(i, m["tool_calls"])
                if calls:  # vLLM drops an empty list so that templates take the plain assistant path
                    msg["tool_calls"] = calls
            reasoning = _optional_str(i, m, "reasoning")
            if reasoning is None:  # the deprecated name, which vLLM reads when 'reasoning' is absent
                reasoning = _optional_str(i, m, "reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = _optional_str(i, m, "tool_call_id")
        name = _optional_str(i, m, "name")
        if name is not None:
            msg["name"] = name
        if isinstance(m.get("task"), str):
            msg["task"] = m["task"]
        if role == "developer":
            tools = m.get("tools")
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise ChatFormatError(f"messages[{i}].tools must be a list of objects")
            msg["tools"] = tools
        out.append(msg)
    return out


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


def _tag_final(msgs: list[dict[str, Any]]) -> str:
    """Append :data:`CONTINUE_TAG` to the final message's content (its last text part when it is a list), in the
    normalized copy, as ``transformers`` does before rendering; returns that content as it was."""
    final = msgs[-1]["content"]
    if isinstance(final, list):
        for part in reversed(final):
            if "text" in part:
                text = part["text"]
                part["text"] = text + CONTINUE_TAG
                return text
        raise ChatFormatError("'continue_final_message': the final message has no text to continue")
    msgs[-1]["content"] = final + CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    """``transformers``' cut for ``continue_final_message``: the rendered text up to the tag (and without the
    whitespace before it when the template trimmed the message's trailing space)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatFormatError("'continue_final_message': the final message does not appear in the rendered "
                              "prompt (the chat template changes it), so it cannot be continued")
    at = text.rindex(tag)
    if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def _check_flags(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ChatFormatError("'continue_final_message' and 'add_generation_prompt' cannot both be true "
                              "(give \"add_generation_prompt\": false to continue the final message)")


class ChatTemplate(Protocol):
    """Renders validated messages to prompt text; ``name`` identifies the template. ``tools``, ``documents`` and
    ``template_kwargs`` are what vLLM passes to the template (a template that does not use them ignores them)."""

    name: str

    def render(self, messages: object, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str: ...


@dataclass(frozen=True)
class ChatMLTemplate:
    """The fixed ChatML template (module docstring gives its exact output); tools and kwargs do not change it."""

    name: str = "chatml"

    def render(self, messages: object, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        _check_flags(add_generation_prompt, continue_final_message)
        msgs = normalize_messages(messages)
        final = _tag_final(msgs) if continue_final_message else None
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text if final is None else _cut_at_tag(text, final)


def _token_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ChatFormatError(f"special token must be a string or an object with 'content', got {value!r:.60}")


class JinjaChatTemplate:
    """A HuggingFace-style Jinja2 chat template, rendered in the immutable sandbox. ``content_format`` is how
    messages' content reaches it (``quillcache.textproc.content_format``): ``"auto"`` (the default, as vLLM's)
    detects it from the template; the resolved value is the ``content_format`` attribute."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "jinja",
                 content_format: str = "auto") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatFormatError("chat template source must be a non-empty string")
        try:
            from jinja2 import TemplateError
            environment = jinja_environment_class()
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ChatFormatError(f"the 'jinja2' package is needed for a Jinja chat template: {e}") from None
        self.content_format: ContentFormat = _checked_format(content_format, source)

        def raise_exception(message: str) -> None:
            raise ChatFormatError(f"chat template refused the messages: {message}")

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:  # templates that date their system prompt (Llama 3.2/3.3)
            return datetime.datetime.now().strftime(fmt)

        # the globals and filters transformers adds: raise_exception, strftime_now, tojson with its keyword arguments
        env = environment()
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        env.filters["tojson"] = tojson
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatFormatError(f"chat template does not compile: {e}") from None
        # what a template (or a request's tools / kwargs inside it) can raise while rendering
        self._template_error = (TemplateError, TypeError, ValueError, ArithmeticError, LookupError, RecursionError)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name

    @classmethod
    def from_tokenizer_config(cls, path: str | Path, *, template_name: str = "default",
                              content_format: str = "auto") -> JinjaChatTemplate:
        """The ``chat_template`` of a ``tokenizer_config.json`` (a string, or a list of ``{name, template}``)."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer_config.json"
        try:
            cfg = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ChatFormatError(f"no tokenizer_config.json at {str(path)!r}") from None
        except (OSError, ValueError) as e:
            raise ChatFormatError(f"{str(p)!r} is not readable JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ChatFormatError(f"{str(p)!r} must hold a JSON object")
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            if template_name not in named:
                raise ChatFormatError(f"{str(p)!r} has no chat template named {template_name!r}; "
                                      f"it has {sorted(str(k) for k in named)}")
            tpl = named[template_name]
        if not isinstance(tpl, str):
            raise ChatFormatError(f"{str(p)!r} has no 'chat_template' string")
        return cls(tpl, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                   name=f"jinja:{p.parent.name}", content_format=content_format)

    def render(self, messages: object, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        _check_flags(add_generation_prompt, continue_final_message)
        msgs = normalize_messages(messages, self.content_format)
        final = None
        if continue_final_message:
            if "content" not in self.source:  # transformers' check: the template never reads a message's content
                raise ChatFormatError("'continue_final_message': this chat template does not render messages' "
                                      "content, so the final message cannot be continued")
            final = _tag_final(msgs)
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        for key, value in (template_kwargs or {}).items():
            if key in _RESERVED_KWARGS:
                raise ChatFormatError(f"template kwarg {key!r} is set by the renderer and cannot be given")
            context[key] = value
        context.update(messages=msgs, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
        try:
            text = self._template.render(**context)
        except ChatFormatError:
            raise
        except self._template_error as e:
            raise ChatFormatError(f"chat template failed to render: {e}") from None
        return text if final is None else _cut_at_tag(text, final)


CHAT_TEMPLATES: Registry = Registry("chat template")
CHAT_TEMPLATES.register("chatml", ChatMLTemplate)
CHAT_TEMPLATES.register("jinja", JinjaChatTemplate.from_tokenizer_config)


def load_chat_template(spec: str | Path | None = None, *, content_format: str = "auto") -> ChatTemplate:
    """``None``/``"chatml"`` -> :class:`ChatMLTemplate`; a ``tokenizer_config.json`` path (or its directory, or
    ``"jinja:PATH"``) -> :class:`JinjaChatTemplate` from its ``chat_template``. ``content_format``: ``"auto"``,
    ``"string"`` or ``"openai"`` (vLLM's ``--chat-template-content-format``); ChatML renders strings and takes only
    ``"auto"`` or ``"string"``."""
    if spec is None or spec == "chatml":
        if _checked_format(content_format, None) != "string":
            raise ChatFormatError("the built-in ChatML template renders string content; content format 'openai' "
                                  "needs a Jinja template that loops over content parts")
        return CHAT_TEMPLATES.create("chatml")
    text = str(spec)
    if text.startswith("jinja:"):
        text = text[6:]
    if not text:  # an empty path would name the working directory
        raise ChatFormatError("empty chat template spec; give 'chatml' or a path to a tokenizer_config.json")
    return CHAT_TEMPLATES["jinja"](text, content_format=content_format)


def _checked_format(requested: str, source: str | None) -> ContentFormat:
    try:
        return resolve_content_format(requested, source)
    except ValueError as e:
        raise ChatFormatError(str(e)) from None
