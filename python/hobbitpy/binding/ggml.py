"""cffi binding of ggml's quantizer and type traits (libggml-base, the pinned llama.cpp's own),
and of its device registry (libggml): how much memory a dedicated GPU has free.

`hobbitpy prepare` quantizes with the very code `llama-quantize` runs, so a companion
file's blocks are what llama.cpp itself would write, and reads any type back as numbers with
ggml's own `to_float`. Types are passed as the integer
values of `enum ggml_type` (an int in the C ABI), which `gguf.GGMLQuantizationType`
mirrors.
"""

from __future__ import annotations

import cffi
import numpy as np

from .native import LIB_DIR

# mirrors ggml/include/ggml.h of the pinned llama.cpp
_CDEF = """
const char * ggml_type_name(int type);
int64_t ggml_blck_size(int type);
size_t  ggml_type_size(int type);
size_t  ggml_row_size(int type, int64_t ne);
bool    ggml_quantize_requires_imatrix(int type);
void    ggml_quantize_init(int type);
size_t  ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start, int64_t nrows,
                            int64_t n_per_row, const float * imatrix);
bool    ggml_validate_row_data(int type, const void * data, size_t nbytes);
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
typedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k);
struct ggml_type_traits {
    const char *      type_name;
    int64_t           blck_size;
    int64_t           blck_size_interleave;
    size_t            type_size;
    bool              is_quantized;
    ggml_to_float_t   to_float;
    ggml_from_float_t from_float_ref;
};
const struct ggml_type_traits * ggml_get_type_traits(int type);
"""
# ggml/include/ggml-backend.h: the devices of the backends loaded (enum ggml_backend_dev_type as an int)
_DEVICE_CDEF = """
typedef struct ggml_backend_device * ggml_backend_dev_t;
size_t     ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
int        ggml_backend_dev_type(ggml_backend_dev_t device);
void       ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
"""
GGML_BACKEND_DEVICE_TYPE_GPU = 1  # dedicated memory (an integrated GPU, a Jetson's, shares the host's)
GGML_TYPE_F32 = 0

ffi = cffi.FFI()
ffi.cdef(_CDEF)
ffi.cdef(_DEVICE_CDEF)
# already loaded by libllama and libhobbit: dlopen returns the same library
lib = ffi.dlopen(str(LIB_DIR / "libggml-base.so"))
registry = ffi.dlopen(str(LIB_DIR / "libggml.so"))


def dedicated_gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the first GPU with memory of its own among the devices of the
    backends loaded (llama_backend_init loads them), or None without one."""
    for i in range(registry.ggml_backend_dev_count()):
        dev = registry.ggml_backend_dev_get(i)
        if registry.ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_GPU:
            free, total = ffi.new("size_t *"), ffi.new("size_t *")
            registry.ggml_backend_dev_memory(dev, free, total)
            return int(free[0]), int(total[0])
    return None


def type_name(type_id: int) -> str:
    return ffi.string(lib.ggml_type_name(type_id)).decode()


def block_size(type_id: int) -> int:
    """Values a block of this type holds."""
    return int(lib.ggml_blck_size(type_id))


def type_size(type_id: int) -> int:
    """Bytes of one block of this type."""
    return int(lib.ggml_type_size(type_id))


def row_size(type_id: int, n_per_row: int) -> int:
    """Bytes of a row of n_per_row values of this type."""
    return int(lib.ggml_row_size(type_id, n_per_row))


def requires_imatrix(type_id: int) -> bool:
    """Whether ggml's quantizer refuses this type without an importance matrix."""
    return bool(lib.ggml_quantize_requires_imatrix(type_id))


def prepare_quantizer(type_id: int) -> None:
    """ggml's tables for this type, made once before threads quantize into it."""
    lib.ggml_quantize_init(type_id)


def quantize_into(values: np.ndarray, type_id: int, dst: np.ndarray, importance: np.ndarray | None = None) -> int:
    """float32 [rows, n_per_row] (contiguous) into dst, rows of bytes of this type, by ggml's
    quantizer (prepare_quantizer first); the bytes written. cffi releases the GIL."""
    rows, n_per_row = values.shape
    weights = ffi.NULL if importance is None else ffi.from_buffer("float[]", importance)
    return int(lib.ggml_quantize_chunk(type_id, ffi.from_buffer("float[]", values), ffi.from_buffer(dst), 0, rows,
                                       n_per_row, weights))


def valid_rows(type_id: int, data: np.ndarray, n_bytes: int) -> bool:
    """Whether the first n_bytes of data are valid blocks of this type (finite scales)."""
    return bool(lib.ggml_validate_row_data(type_id, ffi.from_buffer(data), n_bytes))


def can_read_as_float(type_id: int) -> bool:
    return type_id == GGML_TYPE_F32 or lib.ggml_get_type_traits(type_id).to_float != ffi.NULL


def rows_as_float(raw: np.ndarray, type_id: int, n_per_row: int) -> np.ndarray:
    """Rows of a tensor of this type (uint8, one row of bytes each) as float32 [rows,
    n_per_row], by ggml's to_float (cffi releases the GIL: threads run it in parallel)."""
    if type_id == GGML_TYPE_F32:
        return raw.view(np.float32).reshape(len(raw), n_per_row)
    out = np.empty((len(raw), n_per_row), np.float32)
    to_float = lib.ggml_get_type_traits(type_id).to_float
    if to_float == ffi.NULL:
        raise ValueError(f"ggml cannot read type {type_name(type_id)} back as numbers")
    to_float(ffi.from_buffer(np.ascontiguousarray(raw)), ffi.from_buffer("float[]", out), out.size)
    return out


def quantize_rows(values: np.ndarray, type_id: int, importance: np.ndarray | None = None) -> np.ndarray:
    """float32 [rows, n_per_row] as rows of bytes of this type, by ggml's own quantizer (what
    llama-quantize writes; importance: a weight per column, as an importance matrix gives,
    which the lowest-bit types require)."""
    values = np.ascontiguousarray(values, np.float32)
    rows, n_per_row = values.shape
    out = np.empty((rows, row_size(type_id, n_per_row)), np.uint8)
    prepare_quantizer(type_id)
    quantize_into(values, type_id, out, None if importance is None else np.ascontiguousarray(importance, np.float32))
    return out
