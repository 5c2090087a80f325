"""How a chat template expects a message's ``content``: one string, or OpenAI's list of parts.

vLLM decides this per template (its ``--chat-template-content-format``, default ``auto``) and shapes every message
it passes to the template accordingly, so the gateway must decide it the same way or it renders, tokenizes and
hashes a different prompt than the engine behind it:

- ``"string"``: ``content`` is one string (text parts joined with ``"\\n"``; a null content is ``""``);
- ``"openai"``: ``content`` is a list of ``{"type": "text", "text": str}`` parts (a string content is one such part;
  a null content is the empty list).

``auto`` (:func:`detect_content_format`) reads the template's syntax tree, never renders it. The template expects
parts when it loops over a message's content: a ``for`` whose iterable is ``M.content`` or ``M['content']`` (through
any filters, tests or slices), where ``M`` is the target of a ``for`` over ``messages`` or over a variable ``set`` from
``messages`` (again through filters, tests or slices, transitively). Anything else is ``"string"``, and so is a
template that does not parse or that binds one of those loops or assignments to several names at once (vLLM's
detector gives up on those and falls back to ``"string"``). The rule is syntactic, as vLLM's is: a template that
tests ``content is string`` before looping is still ``"openai"`` and is then handed lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Final, Literal

__all__ = ["CONTENT_FORMATS", "ContentFormat", "detect_content_format", "resolve_content_format"]

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS: Final = ("auto", "string", "openai")  # what a user may ask for; "auto" is resolved per template


class _Unsupported(Exception):
    """A construct the detector does not follow (a tuple target): the template falls back to "string"."""


def _loads(node, name: str) -> bool:
    from jinja2 import nodes
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _unwrap(node):
    """Strip what keeps the value's identity for this purpose: filters, tests and slices."""
    from jinja2 import nodes
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _is_var(node, name: str) -> bool:
    return _loads(_unwrap(node), name)


def _is_field(node, name: str, key: str) -> bool:
    """``name.key`` or ``name['key']`` (after :func:`_unwrap`)."""
    from jinja2 import nodes
    node = _unwrap(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _loads(node.node, name)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _loads(node.node, name)
    return False


def _target(node) -> str:
    from jinja2 import nodes
    if not isinstance(node, nodes.Name):
        raise _Unsupported(type(node).__name__)
    return node.name


def _aliases(root, name: str) -> list[str]:
    """``name`` and every variable ``set`` from it, transitively (breadth first)."""
    from jinja2 import nodes
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            if _is_var(assign.node, current):
                lhs = _target(assign.target)
                found.append(lhs)
                if lhs != current:
                    queue.append(lhs)
    return found


def _message_names(root) -> list[str]:
    from jinja2 import nodes
    sources = _aliases(root, "messages")
    return [_target(loop.target) for loop in root.find_all(nodes.For)
            if any(_is_var(loop.iter, s) for s in sources)]


def _content_loops(root) -> Iterator[str]:
    from jinja2 import nodes
    messages = _message_names(root)
    for loop in root.find_all(nodes.For):
        if any(_is_field(loop.iter, m, "content") for m in messages):
            yield _target(loop.target)


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> ContentFormat:
    """The content format a template's source expects (module docstring); never raises."""
    try:
        from jinja2 import TemplateError

        from quillcache.textproc.jinja_env import jinja_environment_class
    except ImportError:  # pragma: no cover - jinja2 is a declared dependency
        return "string"
    try:
        root = jinja_environment_class()().parse(source)
    except TemplateError:
        return "string"
    try:
        next(_content_loops(root))
    except StopIteration:
        return "string"
    except _Unsupported:
        return "string"
    return "openai"


def resolve_content_format(requested: str, source: str | None) -> ContentFormat:
    """``requested`` (one of :data:`CONTENT_FORMATS`) for a template whose Jinja ``source`` is given (None for the
    built-in ChatML template, which renders strings); ``ValueError`` naming the choices for anything else."""
    if requested not in CONTENT_FORMATS:
        raise ValueError(f"chat template content format must be one of {list(CONTENT_FORMATS)}, got {requested!r:.40}")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    return "string" if source is None else detect_content_format(source)
