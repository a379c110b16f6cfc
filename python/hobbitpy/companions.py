"""Where the lower-precision copies of a model's experts live.

A companion file holds only the routed expert tensors of a model, re-quantized to a
lower-precision GGUF type (``hobbitpy prepare`` writes it next to the model). ``--low``
and ``--mid`` name either a type, meaning that default file, or any file path; the
native runtime checks that the file holds the experts of this very model.
"""

from __future__ import annotations

import os
import pathlib

import gguf

from .errors import ModelFileError

# the GGUF types ggml knows, by their usual names (Q2_K, Q4_K, Q8_0, ...)
GGUF_TYPE_NAMES = {t.name.upper(): t.name for t in gguf.GGMLQuantizationType}


def companion_path(model_path: str | os.PathLike, type_name: str) -> pathlib.Path:
    """The default file of a model's experts at type_name: next to the model."""
    model = pathlib.Path(model_path)
    return model.with_name(f"{model.stem}.experts-{GGUF_TYPE_NAMES.get(type_name.upper(), type_name)}.gguf")


def is_type_name(spec: str) -> bool:
    return spec.upper() in GGUF_TYPE_NAMES


def resolve_level(model_path: str | os.PathLike, spec: str, flag: str) -> str:
    """The file behind a --low/--mid value (a type name or a path), which must exist."""
    if is_type_name(spec) and not os.path.exists(spec):
        path = companion_path(model_path, spec)
        if not path.exists():
            type_name = GGUF_TYPE_NAMES[spec.upper()]
            raise ModelFileError(f"{model_path}: no {type_name} copy of its experts ({path} does not exist); "
                                 f"make it with: hobbitpy prepare {model_path} {flag} {type_name}")
        return str(path)
    if not os.path.isfile(spec):
        raise ModelFileError(f"{spec}: no such file (given as {flag}; expected a GGUF file of the model's experts "
                             f"or a type name such as Q2_K)")
    return spec


def resolve_levels(model_path: str | os.PathLike, mid: str | None, low: str | None) -> tuple[str, ...]:
    """Companion files of the levels below the model's, high to low."""
    levels = []
    if mid is not None:
        levels.append(resolve_level(model_path, mid, "--mid"))
    if low is not None:
        levels.append(resolve_level(model_path, low, "--low"))
    return tuple(levels)
