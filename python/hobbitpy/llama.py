"""hobbitpy.Llama: llama-cpp-python's Llama on the patched llama.cpp, with the routed
experts served from a budgeted cache.

Everything llama_cpp.Llama offers (completion, chat completion, streaming, the
OpenAI-style server) works unchanged; the offload is configured by keywords (every
OffloadConfig field: ``cache_mb=``, ``low=``, ``policy=`` ...), by ``offload=`` (an
OffloadConfig, a dict of its fields, or False for stock) or by ``profile=``, and
attached while the model loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import difflib
import inspect
import os
import threading

import gguf
import llama_cpp
import numpy as np

from . import tokens
from .beam_search import beam_search
from ._native import error_buffer, ffi, lib, to_str
from .companions import resolve_levels
from .config import MB, OffloadConfig
from .devices import say_if_gpu_unusable
from .errors import BudgetError, ExpertReadError, HobbitError, ModelFileError
from .memory import ContextShape, OffloadPlan, available_memory_bytes, context_sizes, fit_ubatch, plan_offload
from .model_file import ModelInfo, inspect_model
from .placement import check_profiles, placement_for
from .profile import load_profile, profile_offload

# llama_cpp.Llama's own keywords (it swallows any other one silently)
LLAMA_KEYWORDS = frozenset(inspect.signature(llama_cpp.Llama.__init__).parameters) - {"self", "model_path", "kwargs"}
# OffloadConfig fields accepted as keywords of Llama: all but `enabled` (offload=False) and those
# llama_cpp.Llama already has a keyword of that name for (seed is its sampling seed; the random
# cache policy's seed goes through offload=)
OFFLOAD_KEYWORDS = tuple(f.name for f in dataclasses.fields(OffloadConfig)
                         if f.name != "enabled" and f.name not in LLAMA_KEYWORDS)


def offload_config_of(model_path: str, offload, profile, keywords: dict, preset: str | None = None) -> OffloadConfig:
    """The OffloadConfig Llama(...) runs with: offload (an OffloadConfig, a dict of its
    fields, False for stock) or the profile (a path; default without a preset: the one next
    to the model, if any) or the defaults, then the preset, with the offload keywords on top."""
    if offload is not None and profile is not None:
        raise TypeError("Llama() takes offload= or profile=, not both")
    if offload is not None and preset is not None:
        raise TypeError("Llama() takes offload= or preset=, not both")
    if offload is False:
        if keywords:
            raise TypeError(f"Llama() got offload=False and offload settings ({', '.join(keywords)})")
        return OffloadConfig(enabled=False)
    if isinstance(offload, dict):
        offload = OffloadConfig(**offload)  # an unknown key is a TypeError naming it
    if offload is not None and not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload must be an OffloadConfig, a dict of its fields or False, not {type(offload).__name__}")
    if offload is None:
        if profile is not None:
            offload = OffloadConfig(**load_profile(profile, model_path).settings)
        elif preset is not None:
            offload = OffloadConfig()
        else:
            offload = profile_offload(model_path)
    if preset is not None:
        from .presets import preset_settings

        keywords = {**preset_settings(preset), **keywords}
    return dataclasses.replace(offload, **keywords) if keywords else offload


class Llama(llama_cpp.Llama):
    """A drop-in for ``llama_cpp.Llama`` whose keywords also say how experts are served:
    ``cache_mb``, ``low``, ``mid``, ``high``, ``policy``, ``prefetch_layers``, ``t1``, ``t2``,
    ``mode``, ``hits`` ... (``OFFLOAD_KEYWORDS``, the fields of ``OffloadConfig``), or
    ``offload=OffloadConfig(...)`` / a dict / False, or ``profile=PATH``, or ``preset=NAME``
    (one paper's method, presets.py; keywords win over it). Default: the
    profile next to the model (written by ``hobbitpy tune``), else the built-in defaults.
    A misspelt keyword is a TypeError naming it (llama_cpp.Llama would ignore it).
    ``n_seq_max=W``: a context of W sequences sharing one KV cache, for ``beam_search``."""

    def __init__(self, model_path: str | os.PathLike, *, offload: OffloadConfig | dict | bool | None = None,
                 profile: str | os.PathLike | None = None, preset: str | None = None, **kwargs):
        model_path = os.fspath(model_path)
        # sequences decoded side by side (beam_search's beams); llama_cpp.Llama makes a context of one
        n_seq_max = int(kwargs.pop("n_seq_max", 1))
        if not 1 <= n_seq_max <= llama_cpp.llama_max_parallel_sequences():
            raise ValueError(f"n_seq_max must be 1..{llama_cpp.llama_max_parallel_sequences()}, got {n_seq_max}")
        keywords = {k: kwargs.pop(k) for k in OFFLOAD_KEYWORDS if k in kwargs}
        for k in kwargs:
            # a misspelling is an error; another unknown keyword goes to llama_cpp.Llama, which
            # ignores it as it always has (its own server passes some: rpc_servers, mul_mat_q)
            close = difflib.get_close_matches(k, [*OFFLOAD_KEYWORDS, *LLAMA_KEYWORDS], n=1, cutoff=0.75)
            if k not in LLAMA_KEYWORDS and close:
                raise TypeError(f"Llama() got an unexpected keyword argument {k!r}; did you mean {close[0]!r}?")
        offload = offload_config_of(model_path, offload, profile, keywords, preset)
        say_if_gpu_unusable()
        self.offload_config: OffloadConfig = offload  # what the experts are served with
        self._runtime = ffi.NULL
        self._abort_cb = None
        self._decoding = threading.Lock()
        self.model_info: ModelInfo = inspect_model(model_path)
        # the file of each precision level, high to low; None: the model's own experts (the
        # runtime checks that companions hold this model's experts)
        self.level_paths: tuple[str | None, ...] = (
            resolve_levels(model_path, offload.high_file, offload.mid, offload.low, offload.high_flag) if offload.enabled else (None,))
        levels = tuple(self.model_info if p is None else inspect_model(p) for p in self.level_paths)
        shape = ContextShape.of(kwargs)
        available = available_memory_bytes()
        if shape.n_ubatch is None:  # left open: narrower when the compute buffer would crowd out the experts
            shape = dataclasses.replace(shape, n_ubatch=fit_ubatch(self.model_info, shape, offload, levels, available))
            kwargs["n_ubatch"] = shape.n_ubatch
        context = context_sizes(self.model_info, shape)
        # (a vocabulary-only load makes no context: nothing to refuse, e.g. tokenizing under a cap)
        if context.total > available and not kwargs.get("vocab_only"):  # llama.cpp would only say "Failed to create llama_context"
            raise BudgetError(f"{model_path}: a context of {shape.n_ctx} tokens needs {context.kv / MB:.0f} MB of KV cache "
                              f"and {(context.total - context.kv) / MB:.0f} MB of other buffers, more than the "
                              f"{available / MB:.0f} MB of memory available; use a smaller context (n_ctx, --ctx)")
        context_bytes = context.total if offload.enabled else 0
        self.offload_plan: OffloadPlan = plan_offload(self.model_info, offload, context_bytes, levels,
                                                      available_bytes=available)
        if self.offload_plan.shared_pool:  # a pool per layer does not fit: the plan falls back to one
            offload = self.offload_config = dataclasses.replace(offload, shallow_layers=None)
        if self.offload_plan.budget_bytes is not None:
            self.offload_plan = dataclasses.replace(
                self.offload_plan, reason=f"{self.offload_plan.reason}; ubatches of {shape.n_ubatch} tokens")

        if offload.enabled:
            check_profiles(self.model_info, offload)
        self.placement: tuple[tuple[int, ...], ...] | None = None  # the level of every expert, when placed by importance
        if self.offload_plan.budget_bytes is not None and kwargs.get("lora_path"):
            # an adapter on expert weights would be applied once per pass of a layer
            raise HobbitError(f"{kwargs['lora_path']}: LoRA adapters are not supported with expert offload yet; "
                              "load the model with OffloadConfig(enabled=False)")
        if self.offload_plan.budget_bytes is not None:
            err = error_buffer()
            self.placement = placement_for(self.model_info, offload, self.level_paths, self.offload_plan.budget_bytes)
            params, _c_strings = offload.to_native(self.offload_plan.budget_bytes, self.level_paths,
                                                   self.offload_plan.page_cache_room_bytes, self.placement)
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
        if n_seq_max > 1:
            self._reopen_context(n_seq_max)

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

    def _reopen_context(self, n_seq_max: int, cb_eval=None, cb_eval_user_data=None) -> None:
        """Replace llama_cpp's context of one sequence by one of n_seq_max sharing one KV cache
        (unified: a sequence copied onto another shares its cells, as beams share the prompt),
        with a graph evaluation callback if given (llama_context_params.cb_eval; the caller
        keeps it and its data alive as long as this Llama)."""
        self.context_params.n_seq_max = n_seq_max
        self.context_params.kv_unified = True
        if cb_eval is not None:
            self.context_params.cb_eval = cb_eval
            self.context_params.cb_eval_user_data = cb_eval_user_data
        self._ctx.close()
        self._ctx = self._stack.enter_context(contextlib.closing(
            llama_cpp._internals.LlamaContext(model=self._model, params=self.context_params, verbose=self.verbose)))

    def beam_search(self, prompt: list[int], width: int, n_predict: int):
        """A beam search of `width` beams from the prompt's tokens (beam_search.py); the Llama
        must be made with n_seq_max >= width. Returns a beam_search.BeamResult."""
        if not self._decoding.acquire(blocking=False):
            raise HobbitError("this Llama is decoding in another thread; use one Llama per thread, or a lock "
                              "around its calls")
        try:
            return beam_search(self, prompt, width, n_predict)
        finally:
            self._decoding.release()

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        # llama.cpp's own tokenizer through hobbit_tokenize: a character the vocabulary cannot
        # encode is a TokenizeError, not an abort of the process (another tokenizer, such as a
        # Hugging Face one given as tokenizer=, is left to llama_cpp)
        if type(self.tokenizer_) is not llama_cpp.LlamaTokenizer:
            return super().tokenize(text, add_bos, special)
        return tokens.tokenize(self._model.vocab, self.model_path, text, add_bos, special)

    @property
    def offloaded(self) -> bool:
        """True when the experts run through the expert cache."""
        return self._runtime != ffi.NULL

    def eval(self, tokens):
        # one decode at a time: a second thread in llama_decode on the same context (and the
        # same expert cache) would corrupt both, or crash
        if not self._decoding.acquire(blocking=False):
            raise HobbitError("this Llama is decoding in another thread; use one Llama per thread, or a lock "
                              "around its calls")
        try:
            super().eval(tokens)
        except RuntimeError as e:
            self._raise_read_error(e)
            raise
        finally:
            self._decoding.release()

    def _raise_read_error(self, cause: Exception) -> None:
        if self._runtime == ffi.NULL:
            return
        msg = error_buffer()
        if lib.hobbit_runtime_get_error(self._runtime, msg, len(msg)):
            lib.hobbit_runtime_clear_error(self._runtime)
            raise ExpertReadError(f"an expert could not be read during decode: {to_str(msg)}") from cause

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
        stats["pool_device"] = to_str(lib.hobbit_runtime_pool_device(self._runtime))  # "CPU", or a GPU ("CUDA0")
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
