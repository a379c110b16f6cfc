"""Ctrl-C while `run` streams a reply: it stops the reply, wherever the signal lands.

Python raises KeyboardInterrupt in whatever Python code runs when SIGINT arrives. While a
token is sampled with a logits processor (llama-cpp-python applies `logit_bias`, hence
`--ignore-eos`, as one) that code is a ctypes callback of llama.cpp's sampler, and ctypes
prints an exception raised in a callback as a traceback and drops it: the reply went on and
the next Ctrl-C was taken for the one at the prompt. Here the interrupt is raised as Python
would, except inside such a callback, where it is kept and raised after the token
(`check`).
"""

from __future__ import annotations

import signal

# the ctypes callback through which llama-cpp-python's sampler calls Python (_internals.CustomSampler)
_CALLBACK = ("_internals.py", "apply_wrapper")


def _in_callback(frame) -> bool:
    while frame is not None:
        code = frame.f_code
        if code.co_name == _CALLBACK[1] and code.co_filename.endswith(_CALLBACK[0]):
            return True
        frame = frame.f_back
    return False


class CtrlC:
    """A context in which SIGINT raises KeyboardInterrupt, at once or, from inside a sampler
    callback, at the next check()."""

    def __init__(self):
        self.pending = False
        self._previous = None

    def __enter__(self) -> "CtrlC":
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        if _in_callback(frame):
            self.pending = True
            return
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise the interrupt kept from inside a callback, if any (call it after each token)."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt
