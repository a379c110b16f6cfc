"""Progress bars: tqdm on stderr, drawn only where a person watches it. Into a log file or a
pipe a bar is nothing but carriage-return frames, so there it is left out."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """tqdm(iterable, **kwargs), on stderr unless `file` says otherwise, disabled when that
    stream is not a terminal (or when `disable` says so)."""
    stream = kwargs.setdefault("file", sys.stderr)
    try:
        on_terminal = stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        on_terminal = False
    kwargs["disable"] = bool(kwargs.get("disable")) or not on_terminal
    return tqdm(iterable, **kwargs)
