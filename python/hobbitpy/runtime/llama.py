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
from dataclasses import dataclass
import difflib
import inspect
import os
import sys
import threading

import gguf
import llama_cpp
import numpy as np

from ..files import tokens
from .beam_search import beam_search
from .chat_template import bounded_templates
from ..analysis.simulate import replay
from ..binding import hobbit
from ..binding.native import ffi
from ..settings.config import OffloadConfig
from .default_ladder import (CALIBRATION_CTX, CALIBRATION_TOKENS, Calibration, applies, default_config, quiet,
                             with_kept_prior)
from ..system.devices import gpu_free_bytes, say_if_gpu_unusable
from ..errors import BudgetError, ExpertReadError, HobbitError, ModelFileError, SettingError, TokenizeError
from .gbnf import gbnf_bound_error
from ..settings.generation import DEFAULTS, for_llama_cpp_python, generation_error
from ..analysis.likelihood import Comparison, Reference, ReferenceTable, compare_to_reference, scoring_windows
from ..plan.memory import (COMPUTE_SHARE, MIN_UBATCH, ContextShape, OffloadPlan, available_memory_bytes,
                           cache_too_small_note, context_sizes, default_context, fit_ubatch, plan_offload,
                           return_freed_memory, whole_memory_budget_mb)
from ..files.model_file import ModelInfo, inspect_model
from ..plan.placement import importance_of
from ..plan.run_plan import check_offload_allowed, plan_run
from ..plan.profile import resolve_offload
from ..system.progress import progress_bar
from ..files.tokens import out_of_vocabulary

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
        return resolve_offload(model_path, profile=profile, preset=preset, settings=keywords)[0]
    return dataclasses.replace(offload, **keywords) if keywords else offload


_MODEL_PARAMS = threading.Lock()


@contextlib.contextmanager
def _model_params(**fields):
    """Model parameters llama_cpp.Llama has no keyword for, set on the llama_model_params it
    makes (from llama_model_default_params, which it calls once per load; the lock keeps two
    loads in two threads from seeing each other's)."""
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params

    def with_fields():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    with _MODEL_PARAMS:
        module.llama_model_default_params = with_fields
        try:
            yield
        finally:
            module.llama_model_default_params = default


@dataclass
class Routing:
    """What the routers chose for each evaluated token (Llama.record_routing; trace.py keeps it as a file)."""

    experts: np.ndarray    # int32 [tokens, moe_layers, k]: the selected experts (-1: none)
    weights: np.ndarray    # float32 [tokens, moe_layers, k]: their gate weights
    probs: np.ndarray      # float32 [tokens, moe_layers, n_expert]: the router's full output
    predicted: np.ndarray  # int32 [tokens, moe_layers, lookahead, k]
    inputs: np.ndarray     # float32 [tokens, moe_layers, n_embd] with with_inputs, else empty
    tokens: list[int]      # the tokens evaluated
    seq_start: list[int]   # 1 at the first token of every prompt
    ubatch_start: list[int] = dataclasses.field(default_factory=list)  # 1 at the first token of every ubatch


class Llama(llama_cpp.Llama):
    """A drop-in for ``llama_cpp.Llama`` whose keywords also say how experts are served:
    ``cache_mb``, ``low``, ``mid``, ``high``, ``policy``, ``prefetch_layers``, ``t1``, ``t2``,
    ``mode``, ``hits`` ... (``OFFLOAD_KEYWORDS``, the fields of ``OffloadConfig``), or
    ``offload=OffloadConfig(...)`` / a dict / False, or ``profile=PATH``, or ``preset=NAME``
    (one paper's method, presets.py; keywords win over it). Default: the
    profile next to the model (written by ``hobbitpy tune``), else the built-in defaults.
    A misspelt keyword is a TypeError naming it (llama_cpp.Llama would ignore it).
    ``n_seq_max=W``: a context of W sequences sharing one KV cache, for ``beam_search``.
    ``repack=False``: llama.cpp's ``--no-repack`` (the CPU backend leaves Q4_0/Q4_K/IQ4_NL weights
    mapped instead of copying them repacked into its own memory: stock's setting under a cap).
    Default: repacked where the file fits beside the repacked copy (run_plan.repack_fits), as
    stock runs best in that memory; the expert pools follow it, so their experts compute with
    that stock run's kernels."""

    _closed = False  # set by close(): every later call says so

    def __init__(self, model_path: str | os.PathLike, *, offload: OffloadConfig | dict | bool | None = None,
                 profile: str | os.PathLike | None = None, preset: str | None = None, **kwargs):
        model_path = os.fspath(model_path)
        # sequences decoded side by side (beam_search's beams); llama_cpp.Llama makes a context of one
        n_seq_max = int(kwargs.pop("n_seq_max", 1))
        # llama.cpp's --no-repack: the CPU backend keeps Q4_0/Q4_K/IQ4_NL weights as mapped instead of
        # copying them, repacked, into memory of its own (the copy a capped stock run cannot hold)
        repack = kwargs.pop("repack", None)
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
        self.read_error: str | None = None  # the last decode's failed expert read, until a decode succeeds
        self._decoding = threading.Lock()
        self.model_info: ModelInfo = inspect_model(model_path)
        if "n_ctx" not in kwargs and not kwargs.get("vocab_only"):  # llama_cpp's would be 512, whatever the model
            kwargs["n_ctx"] = default_context(self.model_info, available_memory_bytes(), ContextShape.of(kwargs))
        check_offload_allowed(self.model_info, offload)
        # every layer on a GPU with memory of its own: the pools go there, sized by its free memory
        n_gpu_layers = int(kwargs.get("n_gpu_layers", 0))
        gpu_bytes = gpu_free_bytes(n_gpu_layers < 0 or n_gpu_layers > self.model_info.n_layer)
        default_reason = None  # what the default chose and why, when the config left it the choice
        # (the default's ladder is placed and measured for the host's memory: on such a GPU the
        # model's own experts are served)
        if applies(offload) and self.model_info.is_moe and not kwargs.get("vocab_only") and gpu_bytes is None:
            offload, default_reason = self._default_offload(offload, kwargs)
        prior_reason = None  # the line saying the expert cache's policy came with the calibration kept
        if self.model_info.is_moe and not kwargs.get("vocab_only"):
            offload, prior_reason = with_kept_prior(self.model_info, offload)
        plan = plan_run(self.model_info, offload, ContextShape.of(kwargs), available_memory_bytes(),
                        gpu_bytes=gpu_bytes, vocab_only=bool(kwargs.get("vocab_only")),
                        lora_path=kwargs.get("lora_path"), default_reason=default_reason,
                        cache_reason=prior_reason)
        self.offload_config = plan.offload
        # the file of each precision level, high to low; None: the model's own experts (the
        # runtime checks that companions hold this model's experts)
        self.level_paths: tuple[str | None, ...] = plan.level_paths
        self.offload_plan: OffloadPlan = plan.offload_plan
        self.placement: tuple[tuple[int, ...], ...] | None = plan.placement  # the level of every expert, when placed
        kwargs["n_ubatch"] = plan.shape.n_ubatch
        self.repack: bool = plan.repack if repack is None else bool(repack)  # use_extra_bufts, the pools too
        if plan.offloaded:
            params, _c_strings = plan.offload.to_native(plan.offload_plan.budget_bytes, plan.level_paths,
                                                        plan.offload_plan.page_cache_room_bytes, plan.placement,
                                                        self.repack)
            hobbit.request_offload(params)
        try:
            with _model_params(use_extra_bufts=self.repack), bounded_templates():
                super().__init__(model_path=model_path, **kwargs)
        except ValueError as e:
            if why := hobbit.last_attach_error():
                raise HobbitError(why) from e
            raise ModelFileError(f"{model_path}: llama.cpp could not load the model ({e})") from e
        finally:
            hobbit.cancel_offload_request()  # never leak the request into another load
        if n_seq_max > 1:
            self._reopen_context(n_seq_max)

        if self.offload_plan.budget_bytes is not None:
            model_ptr = ctypes.cast(self._model.model, ctypes.c_void_p).value
            self._runtime = hobbit.runtime_of_model(model_ptr)
            if self._runtime == ffi.NULL:
                raise HobbitError(f"{model_path}: the expert runtime did not attach")
            # a failed expert read stops the decode (llama_decode returns "aborted")
            # instead of letting it finish on missing weights
            self._abort_cb = llama_cpp.ggml_abort_callback(hobbit.ABORT_CALLBACK)
            runtime_ptr = ctypes.c_void_p(hobbit.address(self._runtime))
            llama_cpp.llama_set_abort_callback(self._ctx.ctx, self._abort_cb, runtime_ptr)
            if note := cache_too_small_note(self.model_info, self.offload_stats()["n_slot"]):
                self.offload_plan = dataclasses.replace(self.offload_plan, reason=f"{self.offload_plan.reason}; {note}")

    def _default_offload(self, offload: OffloadConfig, kwargs: dict) -> tuple[OffloadConfig, str | None]:
        """What the default serves (default_ladder.py) where the experts do not all fit; the
        config unchanged (and no line) where they do, or where not even one precision fits (its
        plan says so)."""
        info = self.model_info
        shape = ContextShape.of(kwargs)
        available = available_memory_bytes()
        one = shape if shape.n_ubatch is not None else dataclasses.replace(
            shape, n_ubatch=fit_ubatch(info, shape, offload, (), available))
        try:
            if plan_offload(info, offload, context_sizes(info, one).total, available_bytes=available).budget_bytes is None:
                return offload, None
        except BudgetError:
            return offload, None
        threads = kwargs.get("n_threads") or os.cpu_count() or 1
        return default_config(info, offload, shape, available,
                              lambda text: measure_calibration(info.path, text, threads),
                              lambda reference, config, stop_beyond: compare_ladder(info.path, reference, config, threads,
                                                                                    stop_beyond), threads)

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

    def record_routing(self, prompts: list[list[int]], *, n_predict: int = 0, lookahead: int = 0,
                       with_inputs: bool = False, progress=None, after_prompt=None) -> "Routing":
        """Evaluate each prompt (its tokens in batches), then generate greedily up to n_predict
        tokens in all (or to the end of text or of the context), and return what the routers
        chose for every evaluated token (the runtime's trace; an offloaded Llama only).
        lookahead: also record the top-k of the routers 1..lookahead layers ahead applied to
        each layer's router input; with_inputs: the router inputs themselves; after_prompt(i):
        called once prompt i is evaluated, its logits still in place (one pass serves both).
        Needs a Llama made with logits_all=True (or n_batch=1): otherwise llama.cpp routes in its
        last layer only the tokens whose logits it keeps."""
        if self._runtime == ffi.NULL:
            raise HobbitError(f"{self.model_path}: the expert runtime did not attach; cannot record routing")
        if not self._logits_all and self.n_batch > 1:
            raise HobbitError("record_routing needs a Llama made with logits_all=True (without, llama.cpp's last layer "
                              "routes only the tokens whose logits it keeps)")
        if any(isinstance(ids, (str, bytes)) or not all(isinstance(t, (int, np.integer)) for t in ids) for ids in prompts):
            raise HobbitError("record_routing takes each prompt as a list of token ids (llm.tokenize(text.encode()))")
        hobbit.trace_begin(self._runtime, lookahead, with_inputs)
        try:
            tokens: list[int] = []
            seq_start: list[int] = []
            ubatch_start: list[int] = []
            for i, ids in enumerate(progress(prompts) if progress else prompts):
                room = self.n_ctx() - len(ids)
                self.reset()
                evaluated = list(ids)
                self.eval(ids)
                if after_prompt is not None:
                    after_prompt(i)
                for _ in range(min(n_predict, room) - 1 if n_predict > 0 else 0):
                    nxt = int(np.argmax(self.last_logits()))
                    if nxt == self.token_eos():
                        break
                    self.eval([nxt])
                    evaluated.append(nxt)
                seq_start += [1] + [0] * (len(evaluated) - 1)
                ubatch_start += self._ubatch_starts(len(ids)) + [1] * (len(evaluated) - len(ids))
                tokens += evaluated
            n_layer, depth = ffi.new("int32_t *"), ffi.new("int32_t *")
            n = hobbit.trace_size(self._runtime, n_layer, depth)
            if n != len(tokens):
                raise HobbitError(f"{self.model_path}: the runtime recorded {n} tokens, {len(tokens)} were evaluated")
            info = self.model_info
            L, D, k, E = n_layer[0], depth[0], info.n_expert_used, info.n_expert
            r = Routing(experts=np.empty((n, L, k), np.int32), weights=np.empty((n, L, k), np.float32),
                        probs=np.empty((n, L, E), np.float32), predicted=np.empty((n, L, D, k), np.int32),
                        inputs=np.empty((n, L, info.n_embd) if with_inputs else 0, np.float32),
                        tokens=tokens, seq_start=seq_start, ubatch_start=ubatch_start)

            def ptr(a, ctype):
                return ffi.cast(ctype, a.ctypes.data) if a.size else ffi.NULL

            hobbit.trace_copy(self._runtime, n, ptr(r.experts, "int32_t *"), ptr(r.weights, "float *"),
                                          ptr(r.probs, "float *"), ptr(r.predicted, "int32_t *"),
                                          ptr(r.inputs, "float *"))
            return r
        finally:
            hobbit.trace_end(self._runtime)

    def replay(self, routing: Routing) -> dict:
        """What this Llama's expert cache counts serving `routing` from a cold start, replayed
        offline by the cache's own code (analysis.simulate.replay): offload_stats()'s counters.
        Its offload must be gpu-centric, without prefetch, substitution or neuron options."""
        if not self.offloaded:
            raise HobbitError(f"{self.model_path}: the experts are resident; there is no cache to replay")
        params, _c_strings = self.offload_config.to_native(self.offload_plan.budget_bytes, self.level_paths,
                                                           self.offload_plan.page_cache_room_bytes, self.placement,
                                                           self.repack)
        return replay(self.model_path, params, routing.experts, routing.weights, routing.ubatch_start, routing.seq_start)

    def _ubatch_starts(self, n: int) -> list[int]:
        """1 where llama.cpp starts a ubatch in an eval of n tokens: eval cuts them into batches
        of n_batch, llama_decode each batch into ubatches of n_ubatch."""
        starts = [0] * n
        for batch in range(0, n, self.n_batch):
            for ubatch in range(batch, min(batch + self.n_batch, n), self.context_params.n_ubatch):
                starts[ubatch] = 1
        return starts

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

    def _check_open(self) -> None:
        # llama_cpp's freed model would answer with a misleading TokenizeError, or crash
        if self._closed:
            raise HobbitError("this Llama is closed; make a new one to use the model again")

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        # llama.cpp's own tokenizer through hobbit_tokenize: a character the vocabulary cannot
        # encode is a TokenizeError, not an abort of the process (another tokenizer, such as a
        # Hugging Face one given as tokenizer=, is left to llama_cpp)
        self._check_open()
        if type(self.tokenizer_) is not llama_cpp.LlamaTokenizer:
            return super().tokenize(text, add_bos, special)
        return tokens.tokenize(self._model.vocab, self.model_path, text, add_bos, special)

    def encodable(self, text: str) -> str:
        """The text less the characters this model's vocabulary cannot encode."""
        self._check_open()
        return tokens.encodable(self._model.vocab, text)

    def unencodable(self, text: str) -> str | None:
        """The first character of the text this model's vocabulary cannot encode, said in a
        sentence that names no file; None when it encodes all of it."""
        self._check_open()
        return tokens.unencodable(self._model.vocab, text)

    def grammar_error(self, grammar: str, root: str = "root") -> str | None:
        """Why llama.cpp cannot take this GBNF grammar (None: it can): too big or too deep for
        its recursive parser (gbnf's bounds), or not parsed. Its sampler is made and freed here:
        llama-cpp-python would chain the null sampler llama.cpp returns for a bad grammar, and
        the process dies (SIGSEGV)."""
        self._check_open()
        if why := gbnf_bound_error(grammar):
            return why
        sampler = llama_cpp.llama_sampler_init_grammar(self._model.vocab, grammar.encode("utf-8", "replace"),
                                                       root.encode("utf-8"))
        if not sampler:
            return "the grammar does not parse (GBNF, with a root rule; llama.cpp's log says where)"
        llama_cpp.llama_sampler_free(sampler)
        return None

    # generation: the settings a call leaves out are the shared defaults (generation.py), the
    # same for a completion, a chat, `run` and the server; values out of range are refused
    def create_completion(self, *args, **kwargs):
        settings = self._generation_settings(super().create_completion, args, kwargs)
        if isinstance(settings["prompt"], list) and (why := out_of_vocabulary(settings["prompt"], self.n_vocab())):
            # llama_cpp would fail the decode with "llama_decode returned -1"
            raise TokenizeError(f"prompt: {why}")
        if settings["prompt"] in ("", []) and not self.can_start_empty():
            # llama_cpp's sampler asserts on an empty context (an AssertionError from its depths)
            raise SettingError("the prompt is empty, and this model adds no beginning-of-text token to continue from")
        return super().create_completion(**settings)

    def can_start_empty(self) -> bool:
        """Whether an empty prompt leaves a token to continue from (the model adds one)."""
        return bool(self.tokenize(b"", add_bos=True, special=True))

    def __call__(self, *args, **kwargs):  # llama_cpp's __call__ restates create_completion's own defaults
        return self.create_completion(*args, **kwargs)

    def create_chat_completion(self, *args, **kwargs):
        return super().create_chat_completion(**self._generation_settings(super().create_chat_completion, args, kwargs))

    @staticmethod
    def _generation_settings(method, args: tuple, kwargs: dict) -> dict:
        given = inspect.signature(method).bind(*args, **kwargs).arguments
        settings = {name: value for name, value in DEFAULTS.items() if name not in given} | given
        if why := generation_error(settings):
            raise SettingError(why)
        return for_llama_cpp_python(settings)

    def _init_sampler(self, *args, grammar=None, **kwargs):
        # every completion, chat and stream makes its sampler here: a grammar handed in as a
        # LlamaGrammar is checked as the CLI and the server check theirs
        if grammar is not None and (why := self.grammar_error(grammar._grammar, grammar._root)):
            raise HobbitError(why)
        return super()._init_sampler(*args, grammar=grammar, **kwargs)

    @property
    def offloaded(self) -> bool:
        """True when the experts run through the expert cache."""
        return self._runtime != ffi.NULL

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        self._check_open()
        # llama.cpp looks a token id up with vector::at: one out of range throws through the C
        # API, and the process aborts (prev_tokens are not read)
        if why := out_of_vocabulary(tokens, self.n_vocab()):
            raise TokenizeError(why)
        return super().detokenize(tokens, prev_tokens, special)

    def eval(self, tokens):
        # one decode at a time: a second thread in llama_decode on the same context (and the
        # same expert cache) would corrupt both, or crash
        self._check_open()
        if not self._decoding.acquire(blocking=False):
            raise HobbitError("this Llama is decoding in another thread; use one Llama per thread, or a lock "
                              "around its calls")
        try:
            super().eval(tokens)
            self.read_error = None
        except RuntimeError as e:
            self._raise_read_error(e)
            raise
        finally:
            self._decoding.release()

    def _raise_read_error(self, cause: Exception) -> None:
        if self._runtime == ffi.NULL:
            return
        if (why := hobbit.runtime_error(self._runtime)) is not None:
            self.read_error = why
            raise ExpertReadError(f"an expert could not be read during decode: {self.read_error}") from cause

    def offload_stats(self) -> dict:
        """Counters of the expert cache since load (or the last reset), with "offloaded" (whether
        the experts run through it) and "reason" (why they do, or do not: the plan's words).
        With the experts resident every counter is 0: no expert is read, stock llama.cpp
        computes them all in memory."""
        stats = {"offloaded": self.offloaded, "reason": self.offload_plan.reason}
        stats |= hobbit.stats_as_dict(hobbit.runtime_stats(self._runtime))  # zeros without a runtime
        # "CPU", or a GPU ("CUDA0"); None without a cache
        stats["pool_device"] = hobbit.pool_device(self._runtime) if self.offloaded else None
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
        while self._runtime != ffi.NULL and (s := hobbit.pool_stats(self._runtime, len(pools))) is not None:
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
            hobbit.new_sequence(self._runtime)

    def reset_offload_stats(self) -> None:
        if self._runtime != ffi.NULL:
            hobbit.reset_stats(self._runtime)

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        # the runtime belongs to the model and goes with it
        self._runtime = ffi.NULL
        self._closed = True
        if hasattr(self, "_stack"):  # not there when __init__ failed before llama_cpp's part
            super().close()


def _bar(what: str):
    # at real size each pass reads every expert from the disk: minutes, worth a bar (not where
    # the notes' logger was set to errors only: -q)
    return lambda xs: progress_bar(xs, desc=what, unit="pass", leave=False, disable=quiet())


def measure_calibration(model_path: str, text: str, n_threads: int) -> Calibration:
    """The model's own experts on the calibration text's first CALIBRATION_TOKENS tokens, in
    windows of CALIBRATION_CTX (likelihood.py's), one batched pass each: how much the routers
    weigh each expert (placement.importance_of) and the next-token distributions a ladder is
    compared with. The outputs do not depend on the cache, so it gets what memory allows."""
    info = inspect_model(model_path)
    # logits_all: otherwise llama.cpp drops every row but the last before the last layer. Every
    # token's logits are then kept twice (llama.cpp's and llama_cpp's copy): 1.2 MB a token with a
    # 151k vocabulary, so the passes are shorter where memory is short
    per_token = context_sizes(info, ContextShape(n_ctx=1, n_batch=1, n_ubatch=1, logits_all=True)).logits
    fit = 1 << max(0, int(COMPUTE_SHARE * available_memory_bytes() / per_token).bit_length() - 1)
    n = max(MIN_UBATCH, min(CALIBRATION_CTX, info.n_ctx_train or CALIBRATION_CTX, fit))
    shape = ContextShape(n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True)
    offload = OffloadConfig(cache_mb=whole_memory_budget_mb(info, shape), auto=False)
    with Llama(model_path, offload=offload, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, n_threads=n_threads,
               verbose=False) as llm:
        # the characters this vocabulary cannot encode are left out (calibration text is not the user's)
        ids = llm.tokenize(llm.encodable(text).encode("utf-8"), add_bos=False, special=False)[:CALIBRATION_TOKENS]
        windows = [window for window, _ in scoring_windows(ids, n)]
        table = ReferenceTable(ids, n, llm.n_vocab())
        try:
            routing = llm.record_routing(windows, progress=_bar("calibration"), after_prompt=lambda i: table.add(
                np.array(llm.scores[:len(windows[i])], dtype=np.float32)))
            reference = table.finish()
        except BaseException:
            table.close()
            raise
    return_freed_memory()
    return Calibration(importance_of(routing.experts, routing.weights, info.n_expert), len(routing.tokens),
                       reference=reference)


def compare_ladder(model_path: str, reference: Reference, offload: OffloadConfig, n_threads: int,
                   stop_beyond: float | None = None) -> Comparison:
    """A configuration against the model's own next-token distributions on the calibration windows
    (the last ones left unscored once its mean KL is sure to end beyond stop_beyond)."""
    n = reference.n_ctx
    with Llama(model_path, offload=offload, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, n_threads=n_threads,
               verbose=False) as llm:
        comparison = compare_to_reference(llm, reference, _bar("the ladder"), stop_beyond)
    return_freed_memory()
    return comparison


__all__ = ["Llama"]
