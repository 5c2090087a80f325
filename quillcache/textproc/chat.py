"""Chat templates: OpenAI ``messages`` -> the prompt text that the engine and the gateway both tokenize.

Two templates, registered in :data:`CHAT_TEMPLATES`:

- ``"chatml"`` — :class:`ChatMLTemplate`, the one fixed, documented default (ChatML, as Qwen and many others use)::

      <|im_start|>{role}\\n{content}<|im_end|>\\n      (one per message, in order)
      <|im_start|>assistant\\n                         (when add_generation_prompt)

- ``"jinja"`` — :class:`JinjaChatTemplate`, a HuggingFace-style Jinja2 template (``chat_template`` of a model's
  ``tokenizer_config.json``), rendered in Jinja2's immutable sandbox with ``messages``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token`` and ``raise_exception`` like ``transformers`` does.

Messages are validated first (:func:`normalize_messages`): a non-empty list of objects with a ``role`` in
:data:`ROLES` and a ``content`` that is a string, a list of ``{"type": "text", "text": str}`` parts (joined with no
separator), or null (only for ``assistant``, rendered as ""). Anything else raises :class:`ChatFormatError`
(a ``ValueError``) naming the message index and the field. Rendering is deterministic: the same messages give the
same text, byte for byte, so both sides of the gateway get the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from quillcache.registry import Registry

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


class ChatFormatError(ValueError):
    """Malformed ``messages`` or a template that cannot be loaded or rendered (the message says which)."""


def normalize_messages(messages: object) -> list[dict[str, str]]:
    """Validated ``[{"role", "content"}]`` with ``content`` flattened to ``str`` (see the module docstring)."""
    if not isinstance(messages, list):
        raise ChatFormatError(f"'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        raise ChatFormatError("'messages' is empty")
    if len(messages) > MAX_MESSAGES:
        raise ChatFormatError(f"'messages' has {len(messages)} entries, more than {MAX_MESSAGES}")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r:.40}")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise ChatFormatError(f"messages[{i}].content is missing (only an assistant message may omit it)")
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ChatFormatError(
                        f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": str}} "
                        f"(only text parts are supported)")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts, "
                                  f"got {type(content).__name__}")
        out.append({"role": role, "content": text})
    return out


class ChatTemplate(Protocol):
    """Renders validated messages to prompt text; ``name`` identifies the template."""

    name: str

    def render(self, messages: object, *, add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class ChatMLTemplate:
    """The fixed ChatML template (module docstring gives its exact output)."""

    name: str = "chatml"

    def render(self, messages: object, *, add_generation_prompt: bool = True) -> str:
        msgs = normalize_messages(messages)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text


def _token_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ChatFormatError(f"special token must be a string or an object with 'content', got {value!r:.60}")


class JinjaChatTemplate:
    """A HuggingFace-style Jinja2 chat template, rendered in the immutable sandbox."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "jinja") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatFormatError("chat template source must be a non-empty string")
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise ChatFormatError(f"the 'jinja2' package is needed for a Jinja chat template: {e}") from None

        def raise_exception(message: str) -> None:
            raise ChatFormatError(f"chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ChatFormatError(f"chat template does not compile: {e}") from None
        self._template_error = TemplateError
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name

    @classmethod
    def from_tokenizer_config(cls, path: str | Path, *, template_name: str = "default") -> JinjaChatTemplate:
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
                   name=f"jinja:{p.parent.name}")

    def render(self, messages: object, *, add_generation_prompt: bool = True) -> str:
        msgs = normalize_messages(messages)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatFormatError:
            raise
        except self._template_error as e:
            raise ChatFormatError(f"chat template failed to render: {e}") from None


CHAT_TEMPLATES: Registry = Registry("chat template")
CHAT_TEMPLATES.register("chatml", ChatMLTemplate)
CHAT_TEMPLATES.register("jinja", JinjaChatTemplate.from_tokenizer_config)


def load_chat_template(spec: str | Path | None = None) -> ChatTemplate:
    """``None``/``"chatml"`` -> :class:`ChatMLTemplate`; a ``tokenizer_config.json`` path (or its directory, or
    ``"jinja:PATH"``) -> :class:`JinjaChatTemplate` from its ``chat_template``."""
    if spec is None or spec == "chatml":
        return CHAT_TEMPLATES.create("chatml")
    text = str(spec)
    if text.startswith("jinja:"):
        text = text[6:]
    if not text:  # an empty path would name the working directory
        raise ChatFormatError("empty chat template spec; give 'chatml' or a path to a tokenizer_config.json")
    return CHAT_TEMPLATES["jinja"](text)

