"""A bound on the bytes this thread's Python code may ask for while it runs one piece of
untrusted work (a chat template's render): past it, an allocation fails as MemoryError.

Python's raw allocator, which every block over 512 bytes comes from, is wrapped once by
libhobbit (hobbit-heap-budget.cpp); the wrapper counts only the requests of a thread inside
`heap_budget`, so the rest of the process (other threads, the model's own memory) is untouched.
"""

from __future__ import annotations

import contextlib
import ctypes

from ..binding import hobbit
from ..binding.native import ffi

_PYMEM_DOMAIN_RAW = 0
_installed = False


def _install() -> None:
    """Wraps the raw domain's allocator, through the C API with the GIL held (ctypes.pythonapi
    holds it; cffi's calls release it)."""
    global _installed
    if _installed:
        return
    current = ffi.new("struct hobbit_raw_allocator *")
    wrapped = ffi.new("struct hobbit_raw_allocator *")
    address = ctypes.c_void_p(int(ffi.cast("uintptr_t", current)))
    ctypes.pythonapi.PyMem_GetAllocator(ctypes.c_int(_PYMEM_DOMAIN_RAW), address)
    hobbit.heap_budget_wrap(current, wrapped)
    ctypes.pythonapi.PyMem_SetAllocator(ctypes.c_int(_PYMEM_DOMAIN_RAW),
                                        ctypes.c_void_p(int(ffi.cast("uintptr_t", wrapped))))
    _installed = True


class HeapBudgetSpent(MemoryError):
    """The work asked for more than its budget."""


@contextlib.contextmanager
def heap_budget(max_bytes: int):
    """Within the block, this thread's requests past max_bytes in all fail (MemoryError); an
    exception that leaves the block after one did (the MemoryError, or what the code in the
    block made of it) is a HeapBudgetSpent."""
    _install()
    hobbit.heap_budget_open(max_bytes)
    try:
        yield
    except Exception as e:
        if hobbit.heap_budget_close():
            raise HeapBudgetSpent(f"asked for more than {max_bytes >> 20} MB") from e
        raise
    finally:
        hobbit.heap_budget_close()
