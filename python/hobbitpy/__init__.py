"""hobbitpy: run Mixture-of-Experts GGUF models larger than memory.

llama.cpp (patched) underneath, routed experts served from a budgeted expert cache.
"""

import os as _os

from ._native import LIB_DIR as _LIB_DIR

# llama-cpp-python must load hobbitpy's patched libllama, not its own; it reads this
# variable once, at import
_os.environ["LLAMA_CPP_LIB_PATH"] = str(_LIB_DIR)

from .config import OffloadConfig  # noqa: E402
from .errors import BudgetError, ExpertReadError, HobbitError, ModelFileError  # noqa: E402
from .llama import Llama  # noqa: E402
from .memory import OffloadPlan, available_memory_bytes, plan_offload  # noqa: E402
from .model_file import ModelInfo, inspect_model  # noqa: E402

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
]
