"""hobbitpy: run Mixture-of-Experts GGUF models larger than memory.

llama.cpp (patched) underneath, routed experts served from a budgeted expert cache.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError, version as _version
import os as _os
import sys as _sys

try:
    __version__ = _version("hobbitpy")
except _PackageNotFoundError:  # run from a source tree without an install
    __version__ = "unknown"

from .binding.native import LIB_DIR as _LIB_DIR

# llama-cpp-python must load hobbitpy's patched libllama: it reads this variable once, at
# import (the .pth hook hobbitpy installs sets it at interpreter start already, unless the
# user set another path)
_os.environ["LLAMA_CPP_LIB_PATH"] = str(_LIB_DIR)
# an abort inside ggml would otherwise run gdb (whatever `gdb` is on PATH) on this process
# to print a backtrace; the assertion's own line is still printed
_os.environ.setdefault("GGML_NO_BACKTRACE", "1")
if "llama_cpp.llama_cpp" in _sys.modules:
    _loaded = _os.path.realpath(_sys.modules["llama_cpp.llama_cpp"]._lib._name)
    if _os.path.dirname(_loaded) != _os.path.realpath(_LIB_DIR):
        raise ImportError(f"llama_cpp was imported before hobbitpy and loaded {_loaded}; hobbitpy needs its own "
                          f"patched library in {_LIB_DIR}. Unset LLAMA_CPP_LIB_PATH, or import hobbitpy first.")

from .settings.config import OffloadConfig  # noqa: E402
from .errors import (BudgetError, ChatTemplateError, ExpertReadError, HobbitError, ModelFileError, TokenizeError)  # noqa: E402
from .runtime.llama import Llama  # noqa: E402
from .plan.memory import OffloadPlan, available_memory_bytes, plan_offload  # noqa: E402
from .files.model_file import ModelInfo, inspect_model  # noqa: E402

__all__ = [
    "Llama",
    "OffloadConfig",
    "OffloadPlan",
    "ModelInfo",
    "inspect_model",
    "plan_offload",
    "available_memory_bytes",
    "HobbitError",
    "ModelFileError",
    "BudgetError",
    "ExpertReadError",
    "ChatTemplateError",
    "TokenizeError",
]
