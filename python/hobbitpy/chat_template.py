"""A model's chat template rendered within bounds.

A GGUF carries its chat template as Jinja; llama-cpp-python renders it in Jinja's sandbox,
which keeps a template from the file system but not from running forever: nested
`range(100000)` loops pinned a core of the server for good, and `'x' * 10**10` would take
10 GB at once. Here each render has a deadline, checked at every line of the template's
compiled code; the operators that make large values (`*`, `**`, `+`) refuse a result past
RESULT_BYTES before it is made (Jinja's sandbox routes them through `call_binop`); and a
template's failure (a syntax error, its own `raise_exception`, a deadline missed, a value too
large) is a ChatTemplateError saying so, not a traceback of Jinja's internals.
"""

from __future__ import annotations

import contextlib
import sys
import time

from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp import llama_chat_format

from .errors import ChatTemplateError

# how long one render may take: a real template renders a conversation in milliseconds
RENDER_SECONDS = 2.0
# the largest value one operator of a template may make: a conversation that fills a long
# context is a few MB of text
RESULT_BYTES = 16 << 20


class _TooLarge(Exception):
    pass


def _result_size(operator: str, left, right) -> int:
    """An upper bound of the size of `left operator right`, known before it is computed (0:
    not a sequence that could grow)."""
    sized = (str, bytes, list, tuple)
    if operator == "*" and isinstance(left, int) and isinstance(right, sized):
        left, right = right, left
    if operator == "*" and isinstance(left, sized) and isinstance(right, int):
        return len(left) * max(right, 0)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return (abs(left).bit_length() * right) // 8  # an integer's bytes
    return 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """llama-cpp-python's sandbox, its settings kept, with the growing operators checked."""
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator, left, right):
        if _result_size(operator, left, right) > RESULT_BYTES:
            raise _TooLarge
        return super().call_binop(context, operator, left, right)


class _Overtime(Exception):
    pass


_TOO_LARGE = (f"made a value larger than {RESULT_BYTES >> 20} MB "
              "(a string or list multiplied or added without bound?)")


def _within_deadline(work):
    """work(), stopped by _Overtime at the first line of Python past RENDER_SECONDS from now."""
    deadline = time.monotonic() + RENDER_SECONDS

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Overtime
        return check

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        return work()
    finally:
        sys.settrace(previous)


class BoundedChatFormatter(llama_chat_format.Jinja2ChatFormatter):
    """llama-cpp-python's formatter of a GGUF chat template, each render within RENDER_SECONDS."""

    def __init__(self, template: str, *args, **kwargs):
        # llama-cpp-python's __init__ compiles the template in its own sandbox, whose compiler
        # folds constant expressions unbounded (`7 ** 10**12` would never finish): it gets an
        # empty template, and the real one compiles here, in the bounded sandbox and in time
        super().__init__("", *args, **kwargs)
        self.template = template
        environment = self._environment.environment
        environment.__class__ = _BoundedSandbox
        self.broken = None
        try:
            self._environment = _within_deadline(lambda: environment.from_string(template))
        except _Overtime:
            self.broken = f"{ChatTemplateError.PREFIX} did not compile within {RENDER_SECONDS:g} s"
        except _TooLarge:
            self.broken = f"{ChatTemplateError.PREFIX} {_TOO_LARGE}"
        except Exception as e:  # jinja2's TemplateSyntaxError and kin
            self.broken = f"{ChatTemplateError.PREFIX} does not parse ({e})"

    def __call__(self, **kwargs):
        if self.broken is not None:
            raise ChatTemplateError(self.broken)
        try:
            return _within_deadline(lambda: super(BoundedChatFormatter, self).__call__(**kwargs))
        except _Overtime:
            raise ChatTemplateError(f"{ChatTemplateError.PREFIX} did not render within {RENDER_SECONDS:g} s "
                                    "(a loop without end?)") from None
        except _TooLarge:
            raise ChatTemplateError(f"{ChatTemplateError.PREFIX} {_TOO_LARGE}") from None
        except ChatTemplateError:
            raise
        except Exception as e:  # its raise_exception, or an error inside Jinja
            raise ChatTemplateError(f"{ChatTemplateError.PREFIX} failed on this conversation: {e}") from None


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
