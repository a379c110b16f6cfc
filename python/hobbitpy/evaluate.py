"""Quality of an offload configuration on held-out text: perplexity, and how far its
next-token distributions move from the all-high-precision run (stock llama.cpp).

The text is tokenized with the model's own tokenizer (no BOS) and cut into windows of
n_ctx tokens; window w is evaluated in one batch and its token i predicts token i+1
(the last token of a window predicts the first of the next), so every token but the
very first is scored once. Reference and candidate run window by window in lockstep,
two models in one process: their logits never have to be stored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import math
import os
import tempfile

import numpy as np

from .config import OffloadConfig
from .disk import drop_from_page_cache
from .errors import HobbitError
from .model_file import inspect_model
from .neurons import NEURONS_ON_STOCK, NeuronMaskSpec, attach_neuron_mask, check_arch, neuron_mask_stats


@dataclass
class EvalResult:
    model: str
    n_tokens: int                 # tokens scored
    perplexity: float             # of the candidate configuration
    reference_perplexity: float | None  # of stock llama.cpp (all experts at the file's precision)
    mean_kl: float | None         # mean KL(reference || candidate) per token, in nats
    top1_agreement: float | None  # share of positions where both pick the same next token
    offloaded: bool
    stats: dict | None = None     # the candidate's expert cache counters over the evaluation (None: stock)
    # standard error of log(perplexity / reference perplexity), from the per-token differences
    # of the two negative log-likelihoods: how far the measured increase may be from the text's
    log_ppl_ratio_se: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _window_logits(llm, window: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(window)
    return np.array(llm.scores[: len(window)], dtype=np.float32)


def scoring_windows(ids: list[int], n_ctx: int):
    """(window, targets) pairs: window w is scored in one pass; every token but the first is a target once."""
    for s in range(0, len(ids) - 1, n_ctx):
        window = ids[s: s + n_ctx]
        targets = np.array(ids[s + 1: s + len(window) + 1])
        yield window[: len(targets)], targets  # the last window: no target after the text's end


# the reference's ubatch: its compute buffer grows with it (256 tokens of ref-mixtral's took
# 100 MB, more than a 185 MB cap left), and stock's logits do not depend on it
# (tests/test_memory.py)
REFERENCE_UBATCH = 64

# the scoring works through a window's rows this many at a time: its float64 temporaries
# (log-probabilities, exponentials, differences: about 48 bytes a logit) stay small at any
# vocabulary (16 rows of a 151k one: 117 MB)
ROWS_AT_ONCE = 16


def scoring_bytes(n_ctx: int, n_vocab: int) -> int:
    """What scoring a window holds beside the model: its logits' float32 copy and one chunk's temporaries."""
    return 4 * n_ctx * n_vocab + 48 * ROWS_AT_ONCE * n_vocab


def _store_log_softmax(logits: np.ndarray, targets: np.ndarray, out: np.ndarray) -> float:
    """out[:] = log_softmax(logits) as float32, a chunk of rows at a time; the negative
    log-likelihood of the targets (at float64, as a candidate's is computed)."""
    nll = 0.0
    for r in range(0, len(targets), ROWS_AT_ONCE):
        lp = log_softmax(logits[r: r + ROWS_AT_ONCE])
        nll -= float(lp[np.arange(len(lp)), targets[r: r + ROWS_AT_ONCE]].sum())
        out[r: r + ROWS_AT_ONCE] = lp
    return nll


def _compare_rows(ref_lp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> tuple[float, float, int, np.ndarray]:
    """Against the reference's log-probabilities on a window: the candidate's negative
    log-likelihood, the sum of KL(reference || candidate), the rows where both rank the same
    token first, and per token the reference's log-likelihood minus the candidate's."""
    nll = kl = 0.0
    agree = 0
    diffs = []
    for r in range(0, len(targets), ROWS_AT_ONCE):
        lp = log_softmax(logits[r: r + ROWS_AT_ONCE])
        ref = ref_lp[r: r + ROWS_AT_ONCE]
        at, t = np.arange(len(lp)), targets[r: r + ROWS_AT_ONCE]
        nll -= float(lp[at, t].sum())
        # compared at the reference's precision (float32): the reference's own bits give 0
        ref64, lp64 = ref.astype(np.float64), lp.astype(np.float32).astype(np.float64)
        diffs.append(ref64[at, t] - lp64[at, t])
        kl += float((np.exp(ref64) * (ref64 - lp64)).sum())
        agree += int((ref.argmax(-1) == lp64.argmax(-1)).sum())
    return nll, kl, agree, np.concatenate(diffs)


def _nll_rows(logits: np.ndarray, targets: np.ndarray) -> float:
    nll = 0.0
    for r in range(0, len(targets), ROWS_AT_ONCE):
        lp = log_softmax(logits[r: r + ROWS_AT_ONCE])
        nll -= float(lp[np.arange(len(lp)), targets[r: r + ROWS_AT_ONCE]].sum())
    return nll


def _n_vocab(model_path: str) -> int:
    from .model_file import inspect_model

    return inspect_model(model_path).n_vocab


def _open(model_path: str, offload: OffloadConfig, n_ctx: int, n_ubatch: int, n_threads: int | None,
          neurons: NeuronMaskSpec | None = None):
    from .llama import Llama

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
    """The candidate's counters: its expert cache's, or the neuron mask's."""
    return neuron_mask_stats(llm) if neurons is not None else llm.offload_stats()


def tokenize_text(model_path: str | os.PathLike, text: str, max_tokens: int | None = None) -> list[int]:
    """The text as the model's tokenizer cuts it (no BOS), at most max_tokens; at least 2 tokens."""
    from .tokens import Vocabulary

    with Vocabulary(model_path) as vocab:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    ids = ids[:max_tokens] if max_tokens is not None else ids
    if len(ids) < 2:
        raise HobbitError(f"the text has {len(ids)} token(s) with this model's tokenizer; evaluation needs at least 2")
    return ids


@dataclass
class Reference:
    """The reference's next-token log-probabilities on fixed tokens, kept to score many candidates against."""

    ids: list[int]
    n_ctx: int
    log_probs: list[np.ndarray]   # one [window, n_vocab] array per window (float32)
    perplexity: float
    store: object = field(default=None, repr=False)  # the temporary file log_probs are views of
    window_nll: list[float] = field(default_factory=list)  # each window's negative log-likelihood

    @property
    def n_vocab(self) -> int:
        return self.log_probs[0].shape[1]

    @classmethod
    def measure(cls, model_path: str | os.PathLike, ids: list[int], *, n_ctx: int = 256, n_threads: int | None = None,
                offload: OffloadConfig = OffloadConfig(enabled=False)) -> "Reference":
        llm = _open(os.fspath(model_path), offload, n_ctx, min(n_ctx, REFERENCE_UBATCH), n_threads)
        table = ReferenceTable(ids, n_ctx, llm.n_vocab())
        try:
            for window, _ in scoring_windows(ids, n_ctx):
                table.add(_window_logits(llm, window))
            return table.finish()
        except BaseException:
            table.close()
            raise
        finally:
            llm.close()

    def first_windows(self, n_windows: int) -> "Reference":
        """The reference on its first n_windows windows only (fewer tokens to score a slow candidate on)."""
        n_windows = max(1, min(n_windows, len(self.log_probs)))
        log_probs = self.log_probs[:n_windows]
        n = sum(len(lp) for lp in log_probs)
        nll = self.window_nll[:n_windows]
        return Reference(self.ids[: n + 1], self.n_ctx, log_probs, math.exp(sum(nll) / n), self.store, nll)


class ReferenceTable:
    """The reference's log-probabilities, window by window as a model computes them, into a
    temporary file, not the heap: a candidate scored after them sizes its cache from the memory
    left, and a file's pages are the kernel's to reclaim (on the heap, n_tokens x n_vocab floats:
    64 MB for 4096 tokens of a 4096-token vocabulary, 6 GB for 50 k tokens of a 32 k one)."""

    def __init__(self, ids: list[int], n_ctx: int, n_vocab: int):
        self.ids, self.n_ctx = ids, n_ctx
        self.windows = list(scoring_windows(ids, n_ctx))
        self.store = tempfile.TemporaryFile()
        self.table = np.memmap(self.store, dtype=np.float32, mode="w+", shape=(len(ids) - 1, n_vocab))
        self.log_probs: list[np.ndarray] = []
        self.window_nll: list[float] = []
        self.row = 0

    def add(self, logits: np.ndarray) -> None:
        """The logits of the next window (its tokens' rows)."""
        _, targets = self.windows[len(self.log_probs)]
        lp = self.table[self.row: self.row + len(targets)]
        self.window_nll.append(_store_log_softmax(logits[: len(targets)], targets, lp))
        self.log_probs.append(lp)
        self.row += len(targets)

    def finish(self) -> Reference:
        """The reference on the windows added (the first ones; at least one)."""
        if not self.log_probs:
            raise HobbitError("the reference has none of its windows")
        self.table.flush()
        os.posix_fadvise(self.store.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # written: read back as scored
        return Reference(self.ids[: self.row + 1], self.n_ctx, self.log_probs,
                         math.exp(sum(self.window_nll) / self.row), self.store, self.window_nll)

    def close(self) -> None:
        self.store.close()


def evaluate_against(model_path: str | os.PathLike, reference: Reference, offload: OffloadConfig, *,
                     n_ubatch: int | None = None, n_threads: int | None = None, progress=None,
                     neurons: NeuronMaskSpec | None = None) -> EvalResult:
    """Perplexity, KL and top-1 agreement of `offload` on `model_path` (the reference's model or
    another file of the same model, e.g. a smaller quant) against a measured reference;
    neurons: CORM's sparse neurons on the stock path instead (offload disabled)."""
    model_path = os.fspath(model_path)
    n_ctx = reference.n_ctx
    # the candidate sizes its cache from the memory left when it opens: the scoring's arrays
    # (a window's log-probabilities and their temporaries) are held by then, and freed for it
    held = np.ones(scoring_bytes(n_ctx, reference.n_vocab), np.uint8)
    candidate = _open(model_path, offload, n_ctx, n_ctx if n_ubatch is None else n_ubatch, n_threads, neurons)
    del held
    nll = kl = 0.0
    agree = n = 0
    diffs = []  # per token: candidate's negative log-likelihood minus the reference's
    try:
        pairs = list(zip(scoring_windows(reference.ids, n_ctx), reference.log_probs))
        for (window, targets), ref_lp in (progress(pairs) if progress else pairs):
            w_nll, w_kl, w_agree, w_diffs = _compare_rows(ref_lp, _window_logits(candidate, window), targets)
            nll, kl, agree, n = nll + w_nll, kl + w_kl, agree + w_agree, n + len(targets)
            diffs.append(w_diffs)
        offloaded, stats = candidate.offloaded, _stats(candidate, neurons)
    finally:
        candidate.close()
    d = np.concatenate(diffs)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    return EvalResult(model=model_path, n_tokens=n, perplexity=math.exp(nll / n),
                      reference_perplexity=reference.perplexity, mean_kl=kl / n, top1_agreement=agree / n,
                      offloaded=offloaded, stats=stats, log_ppl_ratio_se=se)


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
        reference = Reference.measure(model_path, ids, n_ctx=n_ctx, n_threads=n_threads)
        drop_from_page_cache(model_path)
        return evaluate_against(model_path, reference, offload, n_ubatch=n_ubatch, n_threads=n_threads,
                                progress=progress, neurons=neurons)
    held = np.ones(scoring_bytes(n_ctx, _n_vocab(model_path)), np.uint8)
    candidate = _open(model_path, offload, n_ctx, n_ubatch, n_threads, neurons)
    del held
    nll, n = 0.0, 0
    try:
        windows = list(scoring_windows(ids, n_ctx))
        for window, targets in (progress(windows) if progress else windows):
            nll += _nll_rows(_window_logits(candidate, window), targets)
            n += len(targets)
        offloaded, stats = candidate.offloaded, _stats(candidate, neurons)
    finally:
        candidate.close()
    return EvalResult(model=model_path, n_tokens=n, perplexity=math.exp(nll / n), reference_perplexity=None,
                      mean_kl=None, top1_agreement=None, offloaded=offloaded, stats=stats, log_ppl_ratio_se=None)

