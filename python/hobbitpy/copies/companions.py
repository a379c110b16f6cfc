"""The lower-precision copies of a model's experts: their file's keys and types, their sizes,
and where they live.

A companion file holds only the routed expert tensors of a model, re-quantized to a
lower-precision GGUF type (``hobbitpy prepare`` writes it next to the model); a whole
uniform quant of the model (llama.cpp's Q3_K_M, ...) serves as one too: only its expert
tensors are read. ``--low``,
``--mid`` and ``--high`` name either a type, meaning that default file, or any file path;
the native runtime checks that the file holds the experts of this very model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import gguf
from gguf import GGMLQuantizationType as QT
import numpy as np

from ..binding.ggml import block_size, requires_imatrix, type_name, type_size
from ..errors import ModelFileError
from ..files.gguf_fields import field_value
from ..files.model_file import ModelInfo
from .quants import default_quant_dir, is_mix_name, quant_path

KEY_OF = "hobbitpy.companion.of"
KEY_SOURCE = "hobbitpy.companion.source"
KEY_TYPE = "hobbitpy.companion.type"
KEY_IMATRIX = "hobbitpy.companion.imatrix"  # the importance matrix's file name, if one was used
KEY_FALLBACKS = "hobbitpy.companion.fallbacks"
"""One "tensor=TYPE" string per tensor written in another type than KEY_TYPE; absent if none."""
KEY_OF_FINGERPRINT = "hobbitpy.companion.of_fingerprint"  # the runtime checks it (hobbit-expert-store.cpp)
KEY_NEURON_LAYOUT = "hobbitpy.companion.neuron_layout"  # up and down bundled by neuron (expert_index::neuron_layout)
NEURON_LAYOUT_TYPE = "Q8_0"  # the type the runtime's sparse up and down kernels read
NEURON_LAYOUT_ALIGNMENT = 4096  # a neuron layout's tensors start on a page (see the module)

# the quantized types ggml_quantize_chunk handles (ggml.c), where this gguf package knows them
_QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                    "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M",
                    "MXFP4", "NVFP4", "TQ1_0", "TQ2_0", "Q1_0", "Q2_0")

# llama-quant.cpp's tensor_requires_imatrix for a non-embedding tensor: it refuses these
# without an importance matrix (the result would be noise). ggml_quantize_requires_imatrix
# is asked too: ggml aborts the process on a type it names and is given no matrix.
_NEEDS_IMATRIX = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S")


def needs_imatrix(qtype: QT) -> bool:
    return qtype.name in _NEEDS_IMATRIX or requires_imatrix(qtype)


def companion_type(name: str, with_imatrix: bool = False) -> QT:
    """The tensor type `name` stands for (case-insensitive), checked: ggml quantizes to it
    (without an importance matrix unless with_imatrix). Raises ValueError."""
    upper = name.upper()
    allowed = [t for t in _QUANTIZED_TYPES if t in QT.__members__]
    if upper in allowed and not with_imatrix and needs_imatrix(QT[upper]):
        raise ValueError(f"{upper} needs an importance matrix: make one with `hobbitpy imatrix MODEL --text FILE` "
                         "and give it to prepare with --imatrix")
    if upper not in allowed:
        raise ValueError(f"unknown expert type {name!r}; choose one of {', '.join(allowed)}")
    return checked_type(upper)


def default_companion_path(model_path: str | os.PathLike, type_name: str) -> pathlib.Path:
    """Where the companion of this type goes by default: next to the model,
    `<model stem>.experts-<TYPE>.gguf`."""
    model_path = pathlib.Path(model_path)
    return model_path.with_name(f"{model_path.stem}.experts-{companion_type(type_name, with_imatrix=True).name}.gguf")


def default_neuron_layout_path(model_path: str | os.PathLike) -> pathlib.Path:
    """Where `prepare --neuron-layout` writes by default: `<model stem>.neurons-Q8_0.gguf`."""
    model_path = pathlib.Path(model_path)
    return model_path.with_name(f"{model_path.stem}.neurons-{NEURON_LAYOUT_TYPE}.gguf")


def companion_fallbacks(path: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> type, for each tensor of a companion written in another type than
    the one asked for (its rows are not whole blocks of that type)."""
    field = gguf.GGUFReader(path).fields.get(KEY_FALLBACKS)
    if field is None:
        return {}
    entries = [e.decode() for e in field_value(field)[0]]
    return dict(e.split("=", 1) for e in entries)


def copy_layer_bytes(info: ModelInfo, type_name: str) -> np.ndarray:
    """[moe_layers]: one expert's bytes in a copy of this ggml type (gate and up rows n_embd
    long, down rows n_ff long), as `prepare` writes it; 0 where the rows are not whole blocks."""
    qtype = QT[type_name]
    block, block_bytes = block_size(qtype), type_size(qtype)
    if info.n_embd % block or info.n_ff_expert % block:
        return np.zeros(info.n_layer_moe, np.int64)
    one = 3 * info.n_ff_expert * info.n_embd // block * block_bytes  # gate, up and down: n_embd x n_ff each
    return np.full(info.n_layer_moe, one, np.int64)


def estimated_copy(info: ModelInfo, layer_bytes: np.ndarray, path: str | os.PathLike) -> ModelInfo:
    """A copy's file as inspect_model will see it, estimated before it exists (to plan with it)."""
    one = int(layer_bytes[0])
    scale = one / info.expert_bytes
    return dataclasses.replace(info, path=os.fspath(path), expert_bytes=one,
                               expert_bytes_total=one * info.n_expert * info.n_layer_moe,
                               min_budget_bytes=math.ceil(info.min_budget_bytes * scale),
                               max_slice_bytes=math.ceil(info.max_slice_bytes * scale))


def checked_type(name: str) -> QT:
    """gguf's view of the type must be ggml's, or the file's sizes would be wrong."""
    qtype = QT[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if type_name(qtype).upper() != qtype.name or (block_size(qtype), type_size(qtype)) != (block, size):
        raise RuntimeError(f"the gguf package and ggml disagree about type {name} (value {qtype.value}); "
                           "install a gguf matching hobbitpy's llama.cpp")
    return qtype


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
