"""The native libraries: where they are, and the cffi binding of hobbit.h (read from the
header installed beside them).

libllama and libggml* (patched llama.cpp) and libhobbit (the expert runtime) are
installed in ``hobbitpy/lib``. llama-cpp-python loads that libllama through
``LLAMA_CPP_LIB_PATH``, which ``hobbitpy/__init__.py`` sets before importing it, so
its ``Llama`` and ``libhobbit`` share one llama.cpp in the process.
"""

from __future__ import annotations

import os
import pathlib
import re
import sysconfig

import cffi


def _package_data_root() -> pathlib.Path:
    """The folder holding lib/ and data/: next to this file in a wheel install; in an
    editable install the built files stay in site-packages while the sources do not."""
    here = pathlib.Path(__file__).resolve().parent.parent  # (this file is in binding/)
    candidates = [here] + [pathlib.Path(sysconfig.get_path(k)) / "hobbitpy" for k in ("platlib", "purelib")]
    for root in candidates:
        if (root / "lib" / "libhobbit.so").exists():
            return root
    raise ImportError("hobbitpy's native libraries are missing (looked in "
                      + ", ".join(str(c / "lib") for c in candidates) + "); reinstall hobbitpy")


_ROOT = _package_data_root()
DATA_DIR = _ROOT / "data"
# HOBBITPY_LIB_DIR: the libraries of another build of the same sources (the sanitizer
# build of scripts/check-sanitizers.sh) instead of the installed ones
LIB_DIR = pathlib.Path(os.environ["HOBBITPY_LIB_DIR"]) if os.environ.get("HOBBITPY_LIB_DIR") else _ROOT / "lib"

HEADER = _ROOT / "include" / "hobbit.h"  # installed with the libraries it declares


def cdef_of_header(header: str) -> str:
    """hobbit.h as cffi's cdef reads it: the declarations alone, so that the binding is the
    header itself and cannot drift from it. Conditional blocks (extern "C", the export macro's
    definition) and includes go; integer #defines stay, their value computed (cffi reads
    literals only); the others (float constants) go."""
    kept, depth = [], 0
    for line in header.splitlines():
        directive = line.strip()
        if not directive.startswith("#"):
            if depth == 0:
                kept.append(line)
            continue
        word = directive[1:].split(maxsplit=1)[0] if directive[1:].strip() else ""
        if word in ("if", "ifdef", "ifndef"):
            depth += 1
        elif word == "endif":
            depth -= 1
        elif word == "define" and depth == 0:
            m = re.fullmatch(r"#\s*define\s+(\w+)\s+\(?\s*(-?\d+)\s*(?:\*\s*(\d+)\s*)?\)?", directive)
            if m:
                kept.append(f"#define {m[1]} {int(m[2]) * int(m[3] or 1)}")
    text = "\n".join(kept)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return text.replace("HOBBIT_API ", "")


ffi = cffi.FFI()
ffi.cdef(cdef_of_header(HEADER.read_text(encoding="utf-8")))
lib = ffi.dlopen(str(LIB_DIR / "libhobbit.so"))

ERROR_BUFFER_SIZE = 1024


def error_buffer():
    """A char buffer for the ``err`` argument of the C API."""
    return ffi.new("char[]", ERROR_BUFFER_SIZE)


def to_str(buf) -> str:
    return ffi.string(buf).decode("utf-8", "replace")
