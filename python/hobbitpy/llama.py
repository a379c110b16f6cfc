"""hobbitpy.Llama: llama-cpp-python's Llama on the patched llama.cpp, with the routed
experts served from a budgeted cache.

Everything llama_cpp.Llama offers (completion, chat completion, streaming, the
OpenAI-style server) works unchanged; the offload is configured by one extra
argument and attached while the model loads.
"""

from __future__ import annotations

import ctypes
import os

import gguf
import llama_cpp
import numpy as np

from ._native import error_buffer, ffi, lib, to_str
from .companions import resolve_levels
from .config import OffloadConfig
from .errors import ExpertReadError, HobbitError, ModelFileError
from .memory import ContextShape, OffloadPlan, context_sizes, plan_offload
from .model_file import ModelInfo, inspect_model
from .profile import profile_offload


class Llama(llama_cpp.Llama):
    """A drop-in for ``llama_cpp.Llama``; ``offload`` says how experts are served (default: the
    profile next to the model, written by ``hobbitpy tune``, else the built-in defaults)."""

    def __init__(self, model_path: str | os.PathLike, *, offload: OffloadConfig | None = None, **kwargs):
        model_path = os.fspath(model_path)
        # no offload given: the profile `hobbitpy tune` or `calibrate` wrote next to the model, if any
        offload = offload if offload is not None else profile_offload(model_path)
        self._runtime = ffi.NULL
        self._abort_cb = None
        self.model_info: ModelInfo = inspect_model(model_path)
        # the file of each precision level, high to low; None: the model's own experts (the
        # runtime checks that companions hold this model's experts)
        self.level_paths: tuple[str | None, ...] = (
            resolve_levels(model_path, offload.high, offload.mid, offload.low) if offload.enabled else (None,))
        levels = tuple(self.model_info if p is None else inspect_model(p) for p in self.level_paths)
        context_bytes = context_sizes(self.model_info, ContextShape.of(kwargs)).total if offload.enabled else 0
        self.offload_plan: OffloadPlan = plan_offload(self.model_info, offload, context_bytes, levels)

        if self.offload_plan.budget_bytes is not None and kwargs.get("lora_path"):
            # an adapter on expert weights would be applied once per pass of a layer
            raise HobbitError(f"{kwargs['lora_path']}: LoRA adapters are not supported with expert offload yet; "
                              "load the model with OffloadConfig(enabled=False)")
        if self.offload_plan.budget_bytes is not None:
            err = error_buffer()
            params, _c_strings = offload.to_native(self.offload_plan.budget_bytes, self.level_paths,
                                                   self.offload_plan.page_cache_room_bytes)
            if lib.hobbit_request_offload(params, err, len(err)) != 0:
                raise HobbitError(to_str(err))
        try:
            super().__init__(model_path=model_path, **kwargs)
        except ValueError as e:
            why = error_buffer()
            if lib.hobbit_last_attach_error(why, len(why)):
                raise HobbitError(to_str(why)) from e
            raise ModelFileError(f"{model_path}: llama.cpp could not load the model ({e})") from e
        finally:
            lib.hobbit_cancel_offload_request()  # never leak the request into another load

        if self.offload_plan.budget_bytes is not None:
            model_ptr = ctypes.cast(self._model.model, ctypes.c_void_p).value
            self._runtime = lib.hobbit_runtime_of_model(ffi.cast("struct llama_model *", model_ptr))
            if self._runtime == ffi.NULL:
                raise HobbitError(f"{model_path}: the expert runtime did not attach")
            # a failed expert read stops the decode (llama_decode returns "aborted")
            # instead of letting it finish on missing weights
            self._abort_cb = llama_cpp.ggml_abort_callback(int(ffi.cast("uintptr_t", lib.hobbit_abort_callback)))
            runtime_ptr = ctypes.c_void_p(int(ffi.cast("uintptr_t", self._runtime)))
            llama_cpp.llama_set_abort_callback(self._ctx.ctx, self._abort_cb, runtime_ptr)

    @property
    def offloaded(self) -> bool:
        """True when the experts run through the expert cache."""
        return self._runtime != ffi.NULL

    def eval(self, tokens):
        try:
            super().eval(tokens)
        except RuntimeError as e:
            self._raise_read_error(e)
            raise

    def _raise_read_error(self, cause: Exception) -> None:
        if self._runtime == ffi.NULL:
            return
        msg = error_buffer()
        if lib.hobbit_runtime_get_error(self._runtime, msg, len(msg)):
            lib.hobbit_runtime_clear_error(self._runtime)
            raise ExpertReadError(f"expert load failed during decode: {to_str(msg)}") from cause

    def offload_stats(self) -> dict | None:
        """Counters of the expert cache since load (or the last reset); None without offload."""
        if self._runtime == ffi.NULL:
            return None
        s = ffi.new("struct hobbit_stats *")
        lib.hobbit_runtime_get_stats(self._runtime, s)
        stats = {}
        for name in dir(s):
            value = getattr(s, name)
            if isinstance(value, (bool, int, float)):
                stats[name] = value
            else:  # an array, one entry per precision level
                stats[name] = [int(v) for v in value][:s.n_level]
        return stats

    def last_logits(self) -> np.ndarray:
        """Logits of the last evaluated token (a copy), whatever logits_all is: llama_cpp
        fills ``scores`` only with logits_all=True."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx.ctx, -1)
        if not ptr:
            raise HobbitError("no logits: nothing has been evaluated yet")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab(),)).copy()

    def pool_stats(self) -> list[dict]:
        """Counters of each expert pool (one per precision level and expert signature); empty without offload."""
        pools = []
        s = ffi.new("struct hobbit_pool_stats *")
        while self._runtime != ffi.NULL and lib.hobbit_runtime_get_pool_stats(self._runtime, len(pools), s):
            pool = {f: int(getattr(s, f)) for f in ("hits", "misses", "bytes_read", "expert_bytes",
                                                    "n_slot", "n_layer", "level")}
            pool["type"] = gguf.GGMLQuantizationType(s.type).name
            pools.append(pool)
        return pools

    def reset(self) -> None:
        # llama_cpp calls this when a new sequence starts: sequence-level cache records
        # (LFU, LHU) start over, as HOBBIT §3.4 does per sequence
        super().reset()
        if getattr(self, "_runtime", ffi.NULL) != ffi.NULL:
            lib.hobbit_runtime_new_sequence(self._runtime)

    def reset_offload_stats(self) -> None:
        if self._runtime != ffi.NULL:
            lib.hobbit_runtime_reset_stats(self._runtime)

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        # the runtime belongs to the model and goes with it
        self._runtime = ffi.NULL
        if hasattr(self, "_stack"):  # not there when __init__ failed before llama_cpp's part
            super().close()


__all__ = ["Llama"]
