"""Uniform quants of a model, made by llama.cpp's own quantizer (``llama_model_quantize``):
the files a user who cannot hold the model would download instead (Q4_K_M, Q3_K_M, Q2_K,
...), which ``hobbitpy bench --quants`` runs stock llama.cpp on as the baseline to beat.
"""

from __future__ import annotations

import os
import pathlib

from ..errors import HobbitError
from ..system.outputs import partial_output, publish

# llama.h enum llama_ftype: the uniform quant presets of llama-quantize, by their usual names
FTYPES = {
    "Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q5_K_S": 16, "Q4_K_M": 15, "Q4_K_S": 14,
    "Q4_0": 2, "IQ4_XS": 30, "Q3_K_L": 13, "Q3_K_M": 12, "Q3_K_S": 11, "Q2_K": 10,
}


# each preset's base type (llama-quant.cpp's default type of the ftype): most of a mix's expert
# blocks are of it, the rest (some down projections) higher, so a mix spends at least its bits
BASE_TYPES = {
    "Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K", "Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K",
    "Q4_0": "Q4_0", "IQ4_XS": "IQ4_XS", "Q3_K_L": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_S": "Q3_K", "Q2_K": "Q2_K",
}


def is_mix_name(name: str) -> bool:
    """A llama.cpp mix (Q4_K_M, Q3_K_S, ...: a type per tensor kind, its down projections
    higher) rather than one ggml type; bench and the precision levels use both."""
    return name.strip().upper() in FTYPES and name.strip().upper()[-2:] in ("_S", "_M", "_L")


def quant_name(name: str) -> str:
    upper = name.strip().upper()
    if upper not in FTYPES:
        raise ValueError(f"unknown quant {name!r}; choose from {', '.join(FTYPES)}")
    return upper


def default_quant_dir(model_path: str | os.PathLike) -> pathlib.Path:
    """Where bench keeps the quants it made, to reuse them: a folder next to the model."""
    model_path = pathlib.Path(model_path)
    return model_path.with_name(f"{model_path.stem}.quants")


def quant_path(model_path: str | os.PathLike, name: str, folder: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(folder) / f"{pathlib.Path(model_path).stem}.{quant_name(name)}.gguf"


def make_uniform_quant(model_path: str | os.PathLike, name: str, folder: str | os.PathLike,
                       threads: int | None = None) -> tuple[pathlib.Path, bool]:
    """The uniform quant `name` of the model in `folder`: made with llama_model_quantize
    unless it is already there (a quant already made is reused, never overwritten). The
    model may itself be quantized (Q8_0): it is re-quantized, as llama-quantize
    --allow-requantize does. Returns the path and whether it was made now."""
    import llama_cpp

    import hobbitpy  # noqa: F401  (llama_cpp on the patched library)

    out = quant_path(model_path, name, folder)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise HobbitError(f"{out}: exists and is not a regular file; refusing to use it as a quant")
    if out.is_file():
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[quant_name(name)]
    params.nthread = threads or os.cpu_count() or 1
    params.allow_requantize = True
    # a fresh name nobody can have planted a symlink at (llama.cpp opens it for writing); a
    # signal during llama.cpp's call takes effect when it returns, a killed run's file is
    # removed by the next
    with partial_output(out) as tmp:
        # llama.cpp logs every tensor it quantizes: not for the user's terminal
        with llama_cpp._utils.suppress_stdout_stderr(disable=False):
            status = llama_cpp.llama_model_quantize(os.fsencode(model_path), os.fsencode(tmp), params)
        if status != 0:
            raise HobbitError(f"{model_path}: llama.cpp could not quantize it to {name} (status {status})")
        publish(tmp, out)  # fails if a concurrent run made it meanwhile: never overwrite
    return out, True
