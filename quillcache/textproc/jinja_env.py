"""The Jinja2 environment chat templates are parsed and rendered in: the one ``transformers``' ``apply_chat_template``
uses (and vLLM through it), so a template compiles here exactly when it compiles there.

It is an immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop controls (``break``/``continue``) and
``transformers``' ``{% generation %}`` block tag, which renders its body unchanged (it only marks the assistant's
tokens when assistant masks are asked for, which nothing here does). Globals and filters a rendering needs
(``raise_exception``, ``strftime_now``, ``tojson``) are added by each template to its own instance.
"""

from __future__ import annotations

import functools

__all__ = ["jinja_environment_class"]


@functools.lru_cache(maxsize=1)
def jinja_environment_class() -> type:
    """The environment's class (module docstring), built on first use: importing jinja2 is not free."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}``, which ``transformers`` defines for templates that mark the
        assistant's tokens (its AssistantTracker): outside assistant-mask tracking the block renders its body
        unchanged, and so it does here."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
        def __init__(self) -> None:
            super().__init__(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols", GenerationTag])

    return ChatTemplateEnvironment
