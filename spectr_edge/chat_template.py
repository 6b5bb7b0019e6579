"""Chat templates rendered the way transformers renders them, in one sandboxed jinja2 environment
shared by the export (which probes a template for its turn tokens) and the runtime.

transformers compiles a model's chat template in an ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loopcontrols extension ({% break %}, {% continue %}), a
`tojson` filter that keeps non-ASCII text as it is, and the globals raise_exception and
strftime_now. A template that does not compile, or that the sandbox refuses while rendering,
is the bundle's problem or the caller's, reported in one line (TemplateProblem), never a
jinja2 traceback.
"""

from __future__ import annotations

import json
from datetime import datetime


class TemplateProblem(Exception):
    """The template does not compile, refused the messages, or the sandbox stopped it; one line."""


def _raise_exception(message: str):
    raise TemplateProblem(str(message))


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str):
        import jinja2

        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as err:
            raise TemplateProblem(f"the chat template does not compile ({_first_line(err)})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool, **variables) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except TemplateProblem:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
                RecursionError) as err:
            raise TemplateProblem(f"the chat template failed on these messages ({type(err).__name__}: "
                                  f"{_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:200]
