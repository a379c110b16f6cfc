"""Where the lower-precision copies of a model's experts live.

A companion file holds only the routed expert tensors of a model, re-quantized to a
lower-precision GGUF type (``hobbitpy prepare`` writes it next to the model); a whole
uniform quant of the model (llama.cpp's Q3_K_M, ...) serves as one too: only its expert
tensors are read. ``--low``,
``--mid`` and ``--high`` name either a type, meaning that default file, or any file path;
the native runtime checks that the file holds the experts of this very model.
"""

from __future__ import annotations

import os

from .errors import ModelFileError
from .prepare import companion_type, default_companion_path, needs_imatrix
from .quants import default_quant_dir, is_mix_name, quant_path


def resolve_level(model_path: str | os.PathLike, spec: str, flag: str) -> str:
    """The file behind a --high/--mid/--low value, which must exist: a path; a ggml type name
    (Q2_K: the expert-only companion `prepare` writes next to the model); or a llama.cpp mix
    name (Q3_K_M: the uniform quant in MODEL.quants/, whose experts serve as the level)."""
    if os.path.isfile(spec):
        return spec
    if os.path.exists(spec):
        raise ModelFileError(f"{spec}: is not a regular file (given as {flag}; expected a GGUF file of the model's "
                             "experts or a type name such as Q2_K)")
    if is_mix_name(spec):
        path = quant_path(model_path, spec, default_quant_dir(model_path))
        if not path.is_file():
            raise ModelFileError(f"{model_path}: no {spec.upper()} quant of it ({path} does not exist); "
                                 f"make it with: hobbitpy prepare {model_path} {flag} {spec.upper()}")
        return str(path)
    try:
        qtype = companion_type(spec, with_imatrix=True)  # reading a copy needs no matrix; making one may
    except ValueError:
        raise ModelFileError(f"{spec}: no such file (given as {flag}; expected a GGUF file of the model's experts "
                             f"or a type name such as Q2_K)") from None
    type_name = qtype.name
    path = default_companion_path(model_path, type_name)
    if not path.is_file():
        with_matrix = " --imatrix MATRIX (from: hobbitpy imatrix MODEL --text FILE)" if needs_imatrix(qtype) else ""
        raise ModelFileError(f"{model_path}: no {type_name} copy of its experts ({path} does not exist); "
                             f"make it with: hobbitpy prepare {model_path} {flag} {type_name}{with_matrix}")
    return str(path)


def resolve_levels(model_path: str | os.PathLike, high: str | None, mid: str | None,
                   low: str | None, high_flag: str = "--high") -> tuple[str | None, ...]:
    """The file of each precision level, high to low; None for the model's own experts.
    high_flag: the option that named the high level's file (in messages)."""
    levels = [resolve_level(model_path, high, high_flag) if high is not None else None]
    if mid is not None:
        levels.append(resolve_level(model_path, mid, "--mid"))
    if low is not None:
        levels.append(resolve_level(model_path, low, "--low"))
    return tuple(levels)
