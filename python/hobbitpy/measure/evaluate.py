"""Quality of an offload configuration on held-out text: perplexity, and how far its
next-token distributions move from the all-high-precision run (stock llama.cpp), on the
windows likelihood.py cuts the text into. The reference runs first and alone, its
log-probabilities kept in a temporary file, then the candidate alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import math
import os

import numpy as np

from ..settings.config import OffloadConfig
from ..system.disk import drop_from_page_cache
from ..analysis.likelihood import (Reference, ReferenceTable, compare_to_reference, nll_of_rows, scoring_bytes,
                                   scoring_windows, window_logits)
from ..runtime.llama import Llama
from ..files.model_file import inspect_model, model_parts
from ..analysis.neurons import NEURONS_ON_STOCK, NeuronMaskSpec, attach_neuron_mask, check_arch, neuron_mask_stats
from ..files.tokens import tokenize_text


@dataclass
class EvalResult:
    model: str
    n_tokens: int                 # tokens scored
    perplexity: float             # of the candidate configuration
    reference_perplexity: float | None  # of stock llama.cpp (all experts at the file's precision), on the tokens scored
    mean_kl: float | None         # mean KL(reference || candidate) per token, in nats
    top1_agreement: float | None  # share of positions where both pick the same next token
    offloaded: bool
    stats: dict | None = None     # the candidate's expert cache counters over the evaluation (None: stock)
    # standard error of log(perplexity / reference perplexity), from the per-token differences
    # of the two negative log-likelihoods: how far the measured increase may be from the text's
    log_ppl_ratio_se: float | None = None
    # every window of the reference scored (else mean_kl is the least the whole text measures)
    complete: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


# the reference's ubatch: its compute buffer grows with it (256 tokens of ref-mixtral's took
# 100 MB, more than a 185 MB cap left), and stock's logits do not depend on it
# (tests/runtime/test_memory.py)
REFERENCE_UBATCH = 64


def _n_vocab(model_path: str) -> int:
    return inspect_model(model_path).n_vocab


def _open(model_path: str, offload: OffloadConfig, n_ctx: int, n_ubatch: int, n_threads: int | None,
          neurons: NeuronMaskSpec | None = None):
    if n_ctx < 2:
        raise ValueError(f"n_ctx must be at least 2, got {n_ctx}")
    if not 1 <= n_ubatch <= n_ctx:
        raise ValueError(f"n_ubatch must be 1..n_ctx ({n_ctx}), got {n_ubatch}")
    llm = Llama(model_path, offload=offload, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ubatch, logits_all=True,
                verbose=False, n_threads=n_threads or os.cpu_count() or 1)
    if neurons is not None:
        try:
            attach_neuron_mask(llm, neurons)
        except BaseException:
            llm.close()
            raise
    return llm


def _stats(llm, neurons: NeuronMaskSpec | None) -> dict | None:
    """The candidate's counters: its expert cache's (None: its experts resident), or the neuron mask's."""
    if neurons is not None:
        return neuron_mask_stats(llm)
    return llm.offload_stats() if llm.offloaded else None




def measure_reference(model_path: str | os.PathLike, ids: list[int], *, n_ctx: int = 256,
                      n_threads: int | None = None, offload: OffloadConfig = OffloadConfig(enabled=False)) -> Reference:
    """The model's own next-token log-probabilities on the ids (stock llama.cpp by default)."""
    llm = _open(os.fspath(model_path), offload, n_ctx, min(n_ctx, REFERENCE_UBATCH), n_threads)
    table = ReferenceTable(ids, n_ctx, llm.n_vocab())
    try:
        for window, _ in scoring_windows(ids, n_ctx):
            table.add(window_logits(llm, window))
        return table.finish()
    except BaseException:
        table.close()
        raise
    finally:
        llm.close()


def evaluate_against(model_path: str | os.PathLike, reference: Reference, offload: OffloadConfig, *,
                     n_ubatch: int | None = None, n_threads: int | None = None, progress=None,
                     neurons: NeuronMaskSpec | None = None, stop_beyond: float | None = None) -> EvalResult:
    """Perplexity, KL and top-1 agreement of `offload` on `model_path` (the reference's model or
    another file of the same model, e.g. a smaller quant) against a measured reference;
    neurons: CORM's sparse neurons on the stock path instead (offload disabled); stop_beyond: the
    last windows left unscored once the mean KL is sure to end beyond it (compare_to_reference)."""
    model_path = os.fspath(model_path)
    n_ctx = reference.n_ctx
    # the candidate sizes its cache from the memory left when it opens: the scoring's arrays
    # (a window's log-probabilities and their temporaries) are held by then, and freed for it
    held = np.ones(scoring_bytes(n_ctx, reference.n_vocab), np.uint8)
    candidate = _open(model_path, offload, n_ctx, n_ctx if n_ubatch is None else n_ubatch, n_threads, neurons)
    del held
    try:
        c = compare_to_reference(candidate, reference, progress, stop_beyond)
        offloaded, stats = candidate.offloaded, _stats(candidate, neurons)
    finally:
        candidate.close()
    return EvalResult(model=model_path, n_tokens=c.n_tokens, perplexity=c.perplexity,
                      reference_perplexity=c.reference_perplexity, mean_kl=c.mean_kl, top1_agreement=c.top1_agreement,
                      offloaded=offloaded, stats=stats, log_ppl_ratio_se=c.log_ppl_ratio_se, complete=c.complete)


def evaluate(model_path: str | os.PathLike, text: str, offload: OffloadConfig, *, n_ctx: int = 256,
             max_tokens: int | None = None, compare_to_reference: bool = True, n_threads: int | None = None,
             n_ubatch: int | None = None, progress=None, neurons: NeuronMaskSpec | None = None) -> EvalResult:
    """Perplexity of `offload` on `text`, and (compare_to_reference) KL and top-1
    agreement against stock llama.cpp on the same windows. neurons: price CORM's sparse
    neurons instead (on the stock path: offload must be disabled).

    n_ubatch (default n_ctx): tokens per forward pass. Mixed precision decides per pass:
    an expert that any token of the pass wants at high precision serves all of them at
    high, so n_ubatch=1 measures what token-by-token decoding gets."""
    model_path = os.fspath(model_path)
    n_ubatch = n_ctx if n_ubatch is None else n_ubatch
    if neurons is not None:  # before minutes of reference
        if offload.enabled:
            raise ValueError(NEURONS_ON_STOCK)
        check_arch(model_path, inspect_model(model_path).arch)
    ids = tokenize_text(model_path, text, max_tokens)
    if compare_to_reference:
        # the reference first and alone, then the candidate alone: side by side they competed
        # for a memory cap (the reference's compute buffer, touched only as it computes, got
        # the process OOM-killed; its mapped weights left the candidate nothing). Its weights
        # leave the page cache after it, where they would count against the candidate's plan
        reference = measure_reference(model_path, ids, n_ctx=n_ctx, n_threads=n_threads)
        for part in model_parts(model_path):
            drop_from_page_cache(part)
        return evaluate_against(model_path, reference, offload, n_ubatch=n_ubatch, n_threads=n_threads,
                                progress=progress, neurons=neurons)
    held = np.ones(scoring_bytes(n_ctx, _n_vocab(model_path)), np.uint8)
    candidate = _open(model_path, offload, n_ctx, n_ubatch, n_threads, neurons)
    del held
    nll, n = 0.0, 0
    try:
        windows = list(scoring_windows(ids, n_ctx))
        for window, targets in (progress(windows) if progress else windows):
            nll += nll_of_rows(window_logits(candidate, window), targets)
            n += len(targets)
        offloaded, stats = candidate.offloaded, _stats(candidate, neurons)
    finally:
        candidate.close()
    return EvalResult(model=model_path, n_tokens=n, perplexity=math.exp(nll / n), reference_perplexity=None,
                      mean_kl=None, top1_agreement=None, offloaded=offloaded, stats=stats, log_ppl_ratio_se=None)

