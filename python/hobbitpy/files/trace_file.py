"""The routing trace's file: what the routers of a MoE model chose, token by token and layer
by layer (recorded by trace.py), and reading it back with every array checked.

A trace is one ``.npz`` file:

- ``experts``   int32 [tokens, moe_layers, k]: the selected experts (-1: none)
- ``weights``   float32 [tokens, moe_layers, k]: their gate weights
- ``probs``     float16 [tokens, moe_layers, n_expert]: the router's full output
- ``predicted`` int32 [tokens, moe_layers, lookahead, k]: the top-k of the router of the
  layer d = 1..lookahead ahead, applied to this layer's router input (-1 past the end)
- ``seq_start`` uint8 [tokens]: 1 at the first token of every prompt
- ``tokens``    int32 [tokens]: the token evaluated
- ``meta``      a JSON string: model, shapes, expert bytes, prompts, settings
- ``neuron_*``  with ``trace --neurons``: CORM's neuron statistics of every selection
  (NeuronStats below: active and predicted shares, recall, per threshold)

Each evaluated token is one row, prompt tokens and generated ones alike (a prompt is
evaluated in batches, its rows in token order).
"""

from __future__ import annotations

from dataclasses import dataclass
import io
import json
import math
import os
import pathlib
import zipfile
import zlib

import numpy as np

from ..errors import HobbitError
from ..system.outputs import write_new

TRACE_VERSION = 1

@dataclass
class NeuronStats:
    thetas: np.ndarray     # float32 [n_theta]
    active: np.ndarray     # float16 [tokens, moe_layers, k, n_theta]: active share of each selection's expert
    predicted: np.ndarray  # float16 [tokens, moe_layers, k, n_theta]: predicted share (NaN in the first MoE layer)
    recall: np.ndarray     # float16 [tokens, moe_layers, k, n_theta]: active neurons predicted (NaN: none active or no prediction)
    # the sets themselves, for the neuron cache's replay (neuron_sim.py): uint8 [tokens, moe_layers,
    # k, n_theta, ceil(n_ff / 8)], bit i of byte i / 8 = neuron i (numpy's packbits, little bit
    # order); predicted: every neuron in the first MoE layer (computed whole)
    active_bits: np.ndarray | None = None
    predicted_bits: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """As saved in a trace file (the sets only where there are some)."""
        arrays = {"neuron_thetas": self.thetas, "neuron_active": self.active, "neuron_predicted": self.predicted,
                  "neuron_recall": self.recall, "neuron_active_bits": self.active_bits,
                  "neuron_predicted_bits": self.predicted_bits}
        return {k: v for k, v in arrays.items() if v is not None}

    @classmethod
    def of_arrays(cls, arrays) -> "NeuronStats | None":
        if "neuron_thetas" not in arrays:
            return None
        return cls(arrays["neuron_thetas"], arrays["neuron_active"], arrays["neuron_predicted"], arrays["neuron_recall"],
                   arrays.get("neuron_active_bits"), arrays.get("neuron_predicted_bits"))


@dataclass
class Trace:
    experts: np.ndarray
    weights: np.ndarray
    probs: np.ndarray
    predicted: np.ndarray
    seq_start: np.ndarray
    tokens: np.ndarray
    meta: dict
    neurons: NeuronStats | None = None
    inputs: np.ndarray | None = None  # the router inputs, when record_trace kept them (never saved)

    @property
    def n_tokens(self) -> int:
        return int(self.experts.shape[0])

    def save(self, path: str | os.PathLike, replace: bool = False) -> pathlib.Path:
        """Write the trace to a new file (with replace, over a regular file; never through a symlink)."""
        path = pathlib.Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"{path}: a trace is written as .npz; name the file accordingly")
        buf = io.BytesIO()
        np.savez_compressed(buf, experts=self.experts, weights=self.weights, probs=self.probs,
                            predicted=self.predicted, seq_start=self.seq_start, tokens=self.tokens,
                            meta=np.array(json.dumps(self.meta)), **(self.neurons.arrays() if self.neurons else {}))
        return write_new(path, buf.getvalue(), replace)


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by ``Trace.save``; a bad file gets an error naming it. Nothing is
    allocated for an array before its type and shape are checked against the trace's meta and
    its size against the file's (a zip bomb is refused from the zip's own records)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise HobbitError(f"{path}: no such trace file")
    try:
        with zipfile.ZipFile(path) as z:
            members = set(z.namelist())
            names = [*_ARRAYS, "meta", *(_NEURON_ARRAYS if "neuron_thetas.npy" in members else ())]
            headers = {name: _array_header(z, name) for name in names if f"{name}.npy" in members}
            missing = [name for name in (*_ARRAYS, "meta") if name not in headers]
            if missing:
                raise HobbitError(f"{path}: not a hobbitpy trace (no {', '.join(missing)} array)")
            _check_expansion(path, headers)
            if headers["meta"].dtype.kind != "U" or headers["meta"].shape != ():
                raise HobbitError(f"{path}: not a hobbitpy trace (its meta is not a JSON string)")
            meta = json.loads(str(_read_array(z, "meta")))
            _check_meta(path, meta)
            _check_shapes(path, headers, meta)
            arrays = {name: _read_array(z, name) for name in headers if name != "meta"}
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # no end record, a bad CRC, a broken stream
        if _starts_like_a_zip(path):
            raise HobbitError(f"{path}: a trace cut short or damaged ({e})") from None
        raise HobbitError(f"{path}: not a hobbitpy trace ({e})") from None
    except (OSError, ValueError, NotImplementedError, RuntimeError) as e:
        # a header numpy cannot parse or bad JSON (ValueError), a compression or an encryption
        # zipfile does not read (NotImplementedError, RuntimeError)
        raise HobbitError(f"{path}: not a hobbitpy trace ({e})") from None
    for name in ("experts", "predicted"):
        _check_expert_ids(path, name, arrays[name], meta["n_expert"])
    neurons = NeuronStats.of_arrays({k: v for k, v in arrays.items() if k.startswith("neuron_")})
    return Trace(meta=meta, neurons=neurons, **{k: v for k, v in arrays.items() if k in _ARRAYS})


# the arrays of a trace file: their type and shape, by the letters of _check_shapes (n rows,
# L MoE layers, k experts used, E experts, D layers of lookahead, T neuron thresholds,
# B bytes of a neuron set); the neuron arrays come with neuron_thetas
_ARRAYS = {"experts": (np.int32, "nLk"), "weights": (np.float32, "nLk"), "probs": (np.float16, "nLE"),
           "predicted": (np.int32, "nLDk"), "seq_start": (np.uint8, "n"), "tokens": (np.int32, "n")}
_NEURON_ARRAYS = {"neuron_thetas": (np.float32, "T"), "neuron_active": (np.float16, "nLkT"),
                  "neuron_predicted": (np.float16, "nLkT"), "neuron_recall": (np.float16, "nLkT"),
                  "neuron_active_bits": (np.uint8, "nLkTB"), "neuron_predicted_bits": (np.uint8, "nLkTB")}
# a routing trace compresses 1.5 to 2.5 times (probabilities and gate weights hardly at all;
# ref-mixtral's, with and without neuron sets), a zip bomb of zeros a thousand times: the
# arrays may take this many times the file's size, and any that take less than
# SMALL_TRACE_BYTES are read
MAX_TRACE_EXPANSION = 32
SMALL_TRACE_BYTES = 64 << 20


@dataclass(frozen=True)
class _Header:
    shape: tuple[int, ...]
    dtype: np.dtype
    member_bytes: int  # what the zip says the member holds, the .npy header included

    @property
    def n_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _array_header(z: zipfile.ZipFile, name: str) -> _Header:
    """The shape and type an array member declares, read from its .npy header alone; a member
    whose size in the zip is not exactly that header and those bytes is refused (numpy would
    allocate what the header says before it reads the data)."""
    info = z.getinfo(f"{name}.npy")
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"the {name} array is in .npy format {version[0]}.{version[1]}")
        if any(d < 0 for d in shape):
            raise ValueError(f"the {name} array declares the shape {shape}")
        header = _Header(tuple(shape), dtype, info.file_size)
        if info.file_size != f.tell() + header.n_bytes:
            raise ValueError(f"the {name} array declares {header.n_bytes} bytes of {dtype} {header.shape}, its "
                             f"member holds {info.file_size - f.tell()}")
    return header


def _read_array(z: zipfile.ZipFile, name: str) -> np.ndarray:
    with z.open(f"{name}.npy") as f:
        return np.lib.format.read_array(f, allow_pickle=False)


def _check_expansion(path: pathlib.Path, headers: dict[str, _Header]) -> None:
    total = sum(h.member_bytes for h in headers.values())
    size = path.stat().st_size
    if total > max(SMALL_TRACE_BYTES, MAX_TRACE_EXPANSION * size):
        raise HobbitError(f"{path}: its arrays would take {total / 2**30:.2f} GiB once read, {total / size:.0f} times "
                          "the file's size (a trace compresses about 2 times): refused as a zip bomb or a damaged file")


def _starts_like_a_zip(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _check_meta(path: pathlib.Path, meta) -> None:
    """The trace's own description: the version, and the sizes its arrays' shapes and the
    simulator's figures come from."""
    if not isinstance(meta, dict):
        raise HobbitError(f"{path}: not a hobbitpy trace (its meta is not a JSON object)")
    if meta.get("trace_version") != TRACE_VERSION:
        raise HobbitError(f"{path}: trace version {meta.get('trace_version')} is not the supported {TRACE_VERSION}")
    for key, low, high in (("n_moe_layer", 1, None), ("n_expert", 1, None), ("n_expert_used", 1, meta.get("n_expert")),
                           ("expert_bytes", 1, None), ("lookahead", 0, 4)):
        value = meta.get(key)
        if (not isinstance(value, int) or isinstance(value, bool) or value < low
                or (isinstance(high, int) and value > high)):
            bounds = f"{low}..{high}" if isinstance(high, int) else f"an integer of at least {low}"
            raise HobbitError(f"{path}: its meta's {key} must be {bounds}, got {value!r}")


def _check_shapes(path: pathlib.Path, headers: dict[str, _Header], meta: dict) -> None:
    """Every array of the type and shape the meta and the other arrays give it."""
    sizes = {"n": headers["experts"].shape[0] if headers["experts"].shape else 0, "L": meta["n_moe_layer"],
             "k": meta["n_expert_used"], "E": meta["n_expert"], "D": meta["lookahead"]}
    if "neuron_thetas" in headers:
        sizes["T"] = headers["neuron_thetas"].shape[0] if headers["neuron_thetas"].shape else 0
        missing = [name for name in ("neuron_active", "neuron_predicted", "neuron_recall") if name not in headers]
        if missing:
            raise HobbitError(f"{path}: neuron_thetas without {', '.join(missing)}")
        if any(name.endswith("_bits") for name in headers):
            n_ff = meta.get("n_ff_expert")
            if not isinstance(n_ff, int) or isinstance(n_ff, bool) or n_ff < 1:
                raise HobbitError(f"{path}: neuron sets without a positive n_ff_expert in its meta, got {n_ff!r}")
            sizes["B"] = -(-n_ff // 8)
    for name, header in headers.items():
        if name == "meta":
            continue
        dtype, letters = _ARRAYS[name] if name in _ARRAYS else _NEURON_ARRAYS[name]
        want = tuple(sizes[c] for c in letters)
        if header.dtype != np.dtype(dtype) or header.shape != want:
            raise HobbitError(f"{path}: the {name} array is {header.dtype} {header.shape}; the trace's meta and its "
                              f"other arrays make it {np.dtype(dtype)} {want}")


def _check_expert_ids(path: pathlib.Path, name: str, ids: np.ndarray, n_expert: int) -> None:
    bad = (ids < -1) | (ids >= n_expert)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise HobbitError(f"{path}: the {name} array holds expert {int(ids[where])} at {where}; its experts are "
                          f"0..{n_expert - 1} (-1: none)")
