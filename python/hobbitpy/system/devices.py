"""Which compute devices this process has, and the one line a GPU build prints without a GPU.

A CUDA build ships ggml's CUDA backend as a module (``libggml-cuda.so`` beside libggml),
which ggml loads at start only if it can: on a machine without NVIDIA's driver the module
does not load (``libcuda.so.1`` is missing), and a driver without a GPU gives it no
device. ggml's loader is silent about both in a release build, so a user would never learn
why a GPU wheel runs on the CPU; this module says it once per process, as a warning of the
"hobbitpy" logger (the CLI prints it as a note, hidden by -q; in an application it goes
where the application's logging sends warnings, to stderr when nothing is configured).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import llama_cpp

from ..binding.ggml import dedicated_gpu_memory
from ..binding.native import LIB_DIR

_said = threading.Event()


def gpu_module_paths() -> list[str]:
    """The GPU backend modules this build ships (none for a CPU build)."""
    return sorted(str(p) for p in LIB_DIR.glob("libggml-cuda*.so"))


def gpu_usable() -> bool:
    """This build has a GPU backend and ggml found a GPU for it."""
    if not gpu_module_paths():
        return False
    with llama_cpp._utils.suppress_stdout_stderr(disable=False):  # ggml's "loaded ... backend" lines
        llama_cpp.llama_backend_init()  # loads every backend module ggml finds (once per process)
    return bool(llama_cpp.llama_supports_gpu_offload())


def default_gpu_layers() -> int:
    """The CLI's -ngl when not given: every layer on the GPU when there is one (the experts'
    pools are there too: HOBBIT's GPU-centric design), none otherwise (llama.cpp's -1/0)."""
    return -1 if gpu_usable() else 0


def gpu_free_bytes(every_layer_on_gpu: bool) -> int | None:
    """The memory a run's layers and expert pools get on the GPU: its free bytes where every
    layer goes to a GPU with memory of its own (-ngl -1, the CLI's default with a GPU), else
    None (the CPU, a Jetson's GPU sharing the host's memory, or only some layers on the GPU:
    the host's memory is then what limits the run)."""
    if not every_layer_on_gpu or not gpu_usable():
        return None
    memory = dedicated_gpu_memory()
    return None if memory is None else memory[0]


def gpu_unusable_reason() -> str | None:
    """Why the shipped GPU backend serves nothing here, or None (a GPU is usable, or this
    build has no GPU backend)."""
    modules = gpu_module_paths()
    if not modules or gpu_usable():
        return None
    try:
        # the loader's own attempt said nothing: make it again to learn why it failed
        ctypes.CDLL(modules[0])
    except OSError as e:
        why = str(e)
        return why[len(modules[0]) + 2:] if why.startswith(modules[0] + ": ") else why
    return "the CUDA driver reports no device"


def say_if_gpu_unusable() -> None:
    """Warn, once per process, that a GPU build runs on the CPU here, and why."""
    if _said.is_set():
        return
    _said.set()
    why = gpu_unusable_reason()
    if why is not None:
        logging.getLogger("hobbitpy").warning(f"no usable CUDA GPU ({why}): running on the CPU")
