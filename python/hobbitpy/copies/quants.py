"""Uniform quants of a model, made by llama.cpp's own quantizer (``llama_model_quantize``):
the files a user who cannot hold the model would download instead (Q4_K_M, Q3_K_M, Q2_K,
...), which ``hobbitpy bench --quants`` runs stock llama.cpp on as the baseline to beat.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib

from ..errors import HobbitError
from ..system.outputs import partial_output, publish, replace, write_new

log = logging.getLogger("hobbitpy")

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


def source_record_path(quant: str | os.PathLike) -> pathlib.Path:
    """The record beside a quant hobbitpy made of which file it was made from."""
    quant = pathlib.Path(quant)
    return quant.with_name(f"{quant.name.removesuffix('.gguf')}.source.json")


# the bytes of each end of a model hashed to tell one file from another: the header (metadata
# and tensor table) and the last tensors' data, so a retrained model of the same shape differs
FINGERPRINT_BYTES = 1 << 20


def source_fingerprint(model_path: str | os.PathLike) -> dict:
    """What tells this model file from another at the same path or of the same name: its size
    and a hash of its first and last MiB (a whole 27 GB file would take minutes to hash)."""
    size = os.path.getsize(model_path)
    digest = hashlib.sha256()
    with open(model_path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return {"model": os.path.basename(model_path), "bytes": size, "ends_sha256": digest.hexdigest()}


def made_from_another_file(quant: pathlib.Path, model_path: str | os.PathLike) -> bool:
    """Whether hobbitpy made this quant from another file than the model (its record says so).
    A quant without a record was put there by someone else: it is reused as it is."""
    record = source_record_path(quant)
    if not record.is_file():
        return False
    try:
        made_from = json.loads(record.read_text())
    except (OSError, ValueError):
        return True  # a record cut short: the quant beside it is not trusted either
    return made_from != source_fingerprint(model_path)


def make_uniform_quant(model_path: str | os.PathLike, name: str, folder: str | os.PathLike,
                       threads: int | None = None) -> tuple[pathlib.Path, bool]:
    """The uniform quant `name` of the model in `folder`: made with llama_model_quantize
    unless it is already there (a quant already made is reused; one hobbitpy made of another
    file at that name, a model since retrained or replaced, is made again). The model may
    itself be quantized (Q8_0): it is re-quantized, as llama-quantize --allow-requantize
    does. Returns the path and whether it was made now."""
    import llama_cpp

    import hobbitpy  # noqa: F401  (llama_cpp on the patched library)

    out = quant_path(model_path, name, folder)
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise HobbitError(f"{out}: exists and is not a regular file; refusing to use it as a quant")
    stale = out.is_file() and made_from_another_file(out, model_path)
    if out.is_file() and not stale:
        return out, False
    if stale:
        log.info(f"{out}: made from another file than {model_path}; making it again")
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
        if stale:  # hobbitpy's own file, of another model: replaced
            replace(tmp, out)
        else:
            publish(tmp, out)  # fails if a concurrent run made it meanwhile: never overwrite
    write_new(source_record_path(out), json.dumps(source_fingerprint(model_path)) + "\n", replace=True)
    return out, True
