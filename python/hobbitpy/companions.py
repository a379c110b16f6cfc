"""Where the lower-precision copies of a model's experts live.

A companion file holds only the routed expert tensors of a model, re-quantized to a
lower-precision GGUF type (``hobbitpy prepare`` writes it next to the model). ``--low``
and ``--mid`` name either a type, meaning that default file, or any file path; the
native runtime checks that the file holds the experts of this very model.
"""

from __future__ import annotations

import os

from .errors import ModelFileError
from .prepare import companion_type, default_companion_path


def resolve_level(model_path: str | os.PathLike, spec: str, flag: str) -> str:
    """The file behind a --low/--mid value (a type name or a path), which must exist."""
    if os.path.isfile(spec):
        return spec
    try:
        type_name = companion_type(spec).name
    except ValueError:
        raise ModelFileError(f"{spec}: no such file (given as {flag}; expected a GGUF file of the model's experts "
                             f"or a type name such as Q2_K)") from None
    path = default_companion_path(model_path, type_name)
    if not path.is_file():
        raise ModelFileError(f"{model_path}: no {type_name} copy of its experts ({path} does not exist); "
                             f"make it with: hobbitpy prepare {model_path} {flag} {type_name}")
    return str(path)


def resolve_levels(model_path: str | os.PathLike, mid: str | None, low: str | None) -> tuple[str, ...]:
    """Companion files of the levels below the model's, high to low."""
    levels = []
    if mid is not None:
        levels.append(resolve_level(model_path, mid, "--mid"))
    if low is not None:
        levels.append(resolve_level(model_path, low, "--low"))
    return tuple(levels)
