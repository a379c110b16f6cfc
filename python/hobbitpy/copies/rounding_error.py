"""What a low-precision copy loses, expert by expert: the squared error its rounding adds to each
expert's matmul outputs, for the inputs the expert sees.

For an input x the rounding changes a matmul's output by (W - W_copy) x; over inputs whose
columns are independent with mean squares p (an importance matrix's, collected on a text) its
mean square is the sum over columns j of p_j times the column's squared rounding error
sum_i (W - W_copy)_ij^2: what ggml's quantizer itself minimizes with an importance matrix. The
experts differ by factors: on the hardened Mixtral-depth evidence model the first layer's inputs
are large, and its experts lose ten times what a later layer's do at Q2_K (docs/BENCHMARKS.md).
Summed over the expert's tensors (gate, up, down) it prices an expert served from the copy.

Both files are read once, chunk by chunk with pread, dequantized by ggml's to_float on threads:
at real size a pass over the model's experts and the copy's, without filling memory.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import os
import pathlib
import re

import numpy as np

from ..binding.ggml import rows_as_float
from ..errors import ModelFileError
from ..files.tensor_reads import ModelTensors, TensorReads, n_rows
from .prepare import EXPERT_SUFFIXES

_CHUNK_ELEMENTS = 1 << 20  # what one thread dequantizes at a time from each file: 4 MB of float32
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def rounding_error(model_path: str | os.PathLike, copy_path: str | os.PathLike,
                   input_power: dict[str, np.ndarray], threads: int = 2) -> np.ndarray:
    """[moe_layers, n_expert]: for each expert, the sum over its tensors of the squared error the
    copy's rounding adds to the tensor's outputs for an input of these column mean squares
    (input_power: tensor name -> [n_expert, n_col], importance matrix means; a tensor without
    one weighs every column 1). Raises ModelFileError where the copy does not hold the model's
    expert tensors in their shapes."""
    model, copy = ModelTensors(pathlib.Path(model_path)), ModelTensors(pathlib.Path(copy_path))
    copy_tensors = {t.name: t for t in copy.tensors}
    experts = [t for t in model.tensors if t.name.endswith(EXPERT_SUFFIXES)]
    blocks = sorted({int(_BLOCK.match(t.name).group(1)) for t in experts})
    layer_of = {block: il for il, block in enumerate(blocks)}
    n_expert = int(experts[0].shape[2])
    error = np.zeros((len(blocks), n_expert), np.float64)
    model_reads, copy_reads = TensorReads(model), TensorReads(copy)
    pool = ThreadPoolExecutor(threads)
    try:
        for t in experts:
            low = copy_tensors.get(t.name)
            if low is None or [int(n) for n in low.shape] != [int(n) for n in t.shape]:
                raise ModelFileError(f"{copy_path}: no tensor '{t.name}' of the model's shape; not this model's copy")
            n_per_row = int(t.shape[0])
            rows_per_expert = n_rows(t) // n_expert
            power = input_power.get(t.name)
            if power is None or power.shape != (n_expert, n_per_row):
                power = np.ones((n_expert, n_per_row), np.float32)

            def expert_error(e: int, t=t, low=low, n_per_row=n_per_row, rows_per_expert=rows_per_expert,
                             power=power) -> float:
                step = max(1, _CHUNK_ELEMENTS // n_per_row)
                columns = np.zeros(n_per_row, np.float64)
                for first in range(e * rows_per_expert, (e + 1) * rows_per_expert, step):
                    n = min(step, (e + 1) * rows_per_expert - first)
                    d = rows_as_float(model_reads.rows(t, first, n), int(t.tensor_type), n_per_row)
                    d -= rows_as_float(copy_reads.rows(low, first, n), int(low.tensor_type), n_per_row)
                    columns += np.einsum("ij,ij->j", d, d, dtype=np.float64)
                return float(columns @ power[e])

            il = layer_of[int(_BLOCK.match(t.name).group(1))]
            error[il] += np.fromiter(pool.map(expert_error, range(n_expert)), np.float64, n_expert)
            model_reads.done(t)
            copy_reads.done(low)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        model_reads.close()
        copy_reads.close()
    return error
