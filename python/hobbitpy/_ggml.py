"""cffi binding of ggml's quantizer (libggml-base, the pinned llama.cpp's own).

`hobbitpy prepare` quantizes with the very code `llama-quantize` runs, so a companion
file's blocks are what llama.cpp itself would write. Types are passed as the integer
values of `enum ggml_type` (an int in the C ABI), which `gguf.GGMLQuantizationType`
mirrors.
"""

from __future__ import annotations

import cffi

from ._native import LIB_DIR

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
"""

ffi = cffi.FFI()
ffi.cdef(_CDEF)
# already loaded by libllama and libhobbit: dlopen returns the same library
lib = ffi.dlopen(str(LIB_DIR / "libggml-base.so"))


def type_name(type_id: int) -> str:
    return ffi.string(lib.ggml_type_name(type_id)).decode()
