"""A model's chat template rendered within bounds.

A GGUF carries its chat template as Jinja; llama-cpp-python renders it in Jinja's sandbox,
which keeps a template from the file system but not from running forever: nested
`range(100000)` loops pinned a core of the server for good. Here each render has a deadline,
checked at every line of the template's compiled code, and a template's failure (a syntax
error, its own `raise_exception`, a deadline missed) is a ChatTemplateError saying so, not a
traceback of Jinja's internals.
"""

from __future__ import annotations

import contextlib
import sys
import time

from llama_cpp import llama_chat_format

from .errors import ChatTemplateError

# how long one render may take: a real template renders a conversation in milliseconds
RENDER_SECONDS = 2.0


class _Overtime(Exception):
    pass


class BoundedChatFormatter(llama_chat_format.Jinja2ChatFormatter):
    """llama-cpp-python's formatter of a GGUF chat template, each render within RENDER_SECONDS."""

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except Exception as e:  # jinja2's TemplateSyntaxError and kin
            self.broken = f"{ChatTemplateError.PREFIX} does not parse ({e})"
        else:
            self.broken = None

    def __call__(self, **kwargs):
        if self.broken is not None:
            raise ChatTemplateError(self.broken)
        deadline = time.monotonic() + RENDER_SECONDS

        def check(frame, event, arg):
            if time.monotonic() > deadline:
                raise _Overtime
            return check

        previous = sys.gettrace()
        sys.settrace(check)
        try:
            return super().__call__(**kwargs)
        except _Overtime:
            raise ChatTemplateError(f"{ChatTemplateError.PREFIX} did not render within {RENDER_SECONDS:g} s "
                                    "(a loop without end?)") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # its raise_exception, or an error inside Jinja
            raise ChatTemplateError(f"{ChatTemplateError.PREFIX} failed on this conversation: {e}") from None
        finally:
            sys.settrace(previous)


@contextlib.contextmanager
def bounded_templates():
    """While a llama-cpp-python Llama loads: the formatters it makes of its GGUF's templates
    are BoundedChatFormatters (its __init__ builds them from the module's Jinja2ChatFormatter;
    a template that does not parse then fails the conversations that use it, not the load)."""
    original = llama_chat_format.Jinja2ChatFormatter
    llama_chat_format.Jinja2ChatFormatter = BoundedChatFormatter
    try:
        yield
    finally:
        llama_chat_format.Jinja2ChatFormatter = original
