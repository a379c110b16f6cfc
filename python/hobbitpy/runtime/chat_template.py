"""A model's chat template rendered within bounds.

A GGUF carries its chat template as Jinja; llama-cpp-python renders it in Jinja's sandbox,
which keeps a template from the file system but not from running forever or taking the
machine's memory: nested `range(100000)` loops pinned a core of the server for good, and
`'x' * 10**10`, `'x'|center(10**10)` or a string doubled in a loop take gigabytes. Here a
template compiles, and each render runs, within bounds:
- a deadline, checked at every line of the template's compiled code;
- a heap budget (heap_budget.py): the bytes Python asks for meanwhile, past which an
  allocation fails, whichever operator, filter or method asks (one C call can ask for
  gigabytes before the next line);
- integer arithmetic (`*`, `**`), one C call that can run for minutes on numbers that fit the
  budget, refuses a result past INT_BYTES before computing it (Jinja's sandbox routes
  operators through `call_binop`).
A template's failure (a syntax error, its own `raise_exception`, a bound passed) is a
ChatTemplateError saying so, not a traceback of Jinja's internals.
"""

from __future__ import annotations

import contextlib
import sys
import time

from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp import llama_chat_format

from ..errors import ChatTemplateError
from ..system.heap_budget import HeapBudgetSpent, heap_budget

# how long one render may take: a real template renders a conversation in milliseconds
RENDER_SECONDS = 2.0
# what one compile or render may ask of the heap, churn included: a conversation that fills a
# long context is a few MB of text
HEAP_BYTES = 256 << 20
# the largest integer an operator may make: no chat template computes with big numbers
INT_BYTES = 64 << 10


class _IntegerTooLarge(Exception):
    pass


def _integer_result_bytes(operator: str, left, right) -> int:
    """An upper bound of the bytes of integer `left operator right`, known before it is
    computed (0: not integer arithmetic that could grow)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if operator == "*":
        return (abs(left).bit_length() + abs(right).bit_length()) // 8
    if operator == "**" and right > 0:
        return (abs(left).bit_length() * right) // 8
    return 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """llama-cpp-python's sandbox, its settings kept, with integer arithmetic bounded."""
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if _integer_result_bytes(operator, left, right) > INT_BYTES:
            raise _IntegerTooLarge
        return super().call_binop(context, operator, left, right)


class _Overtime(Exception):
    pass


def _bounded(work):
    """work() within HEAP_BYTES, stopped by _Overtime at the first line of Python past
    RENDER_SECONDS from now."""
    deadline = time.monotonic() + RENDER_SECONDS

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise _Overtime
        return check

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        with heap_budget(HEAP_BYTES):
            return work()
    finally:
        sys.settrace(previous)


def _bound_passed(e: Exception) -> str | None:
    """What a template did past its bounds, if this is how its work stopped."""
    if isinstance(e, _Overtime):
        return f"did not finish within {RENDER_SECONDS:g} s (a loop without end?)"
    if isinstance(e, HeapBudgetSpent):
        return f"asked for more than {HEAP_BYTES >> 20} MB of memory (a value grown without bound?)"
    if isinstance(e, _IntegerTooLarge):
        return f"made an integer of more than {INT_BYTES >> 10} KB (arithmetic without bound?)"
    return None


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
            self._environment = _bounded(lambda: environment.from_string(template))
        except Exception as e:  # a bound, or jinja2's TemplateSyntaxError and kin
            passed = _bound_passed(e)
            self.broken = (f"{ChatTemplateError.PREFIX} compiling {passed}" if passed
                           else f"{ChatTemplateError.PREFIX} does not parse ({e})")

    def __call__(self, **kwargs):
        if self.broken is not None:
            raise ChatTemplateError(self.broken)
        try:
            return _bounded(lambda: super(BoundedChatFormatter, self).__call__(**kwargs))
        except ChatTemplateError:
            raise
        except Exception as e:  # a bound, its raise_exception, or an error inside Jinja
            passed = _bound_passed(e)
            raise ChatTemplateError(f"{ChatTemplateError.PREFIX} rendering {passed}" if passed else
                                    f"{ChatTemplateError.PREFIX} failed on this conversation: {e}") from None


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


def chat_format_error(name: str) -> str | None:
    """Why `name` is no chat format llama-cpp-python knows (it would only say so at each
    conversation); None when it is one."""
    try:
        llama_chat_format.LlamaChatCompletionHandlerRegistry().get_chat_completion_handler_by_name(name)
    except llama_chat_format.LlamaChatCompletionHandlerNotFoundException as e:  # its words name the known ones
        return str(e)
    return None
