"""How likely a model's logits make the tokens that follow, and how far a configuration's
next-token distributions are from the model's own: the arithmetic every quality measure here
is made of (`eval`, `tune`, the default's calibration, beam search).

A text's tokens (the model's tokenizer, no BOS) are cut into windows of n_ctx; window w is
evaluated in one batch and its token i predicts token i+1 (the last token of a window predicts
the first of the next), so every token but the very first is scored once. The reference's
log-probabilities go to a temporary file, window by window, and a candidate is compared with
them as it computes its own: two models never have to be in memory at once. A comparison that
may stop early runs its first window in two parts (FIRST_PART), so that a candidate far from
the reference is known after a quarter of a window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
import mmap
import os
import tempfile

import numpy as np

from ..errors import HobbitError

# rows at a time: their float64 temporaries (log-probabilities, exponentials, differences:
# about 48 bytes a logit) stay small at any vocabulary (4 rows of a 151k one: 29 MB), and a
# row is long enough that numpy's per-call cost does not show
ROWS_AT_ONCE = 4
# a comparison that may stop early (stop_beyond) runs its first window's first 1/FIRST_PART on
# its own, then the rest (the KV cache keeps the first part: the same logits but for the order
# of sums, as a prompt in two batches). At real size each part is a pass through every expert,
# a window's tokens are most of its compute, and a candidate far beyond (the default's Q2_K
# ladder on a real-size random-weight model: 0.47 nats a token) is sure to end beyond after a
# quarter of the first window; one that does not stop pays one more pass of what its cache
# does not hold
FIRST_PART = 4


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def nll_of_rows(logits: np.ndarray, targets: np.ndarray, out: np.ndarray | None = None) -> float:
    """The summed negative log-likelihood of targets[i] under row i of the logits (at float64);
    out: also store the log-probabilities there (as its type, float32 for a reference)."""
    nll = 0.0
    for r in range(0, len(targets), ROWS_AT_ONCE):
        lp = log_softmax(logits[r: r + ROWS_AT_ONCE])
        nll -= float(lp[np.arange(len(lp)), targets[r: r + ROWS_AT_ONCE]].sum())
        if out is not None:
            out[r: r + ROWS_AT_ONCE] = lp
    return nll


def window_logits(llm, window: list[int]) -> np.ndarray:
    """A window's logits, every row (the model made with logits_all), from a fresh sequence."""
    (_, logits), = window_logits_in_parts(llm, window, [0, len(window)])
    return logits


def window_logits_in_parts(llm, window: list[int], cuts: list[int]):
    """A window's logits from a fresh sequence, part by part (cuts: the positions where each part
    starts, then the window's length): (start, the part's rows) after each part is evaluated."""
    llm.reset()
    for start, end in zip(cuts[:-1], cuts[1:]):
        llm.eval(window[start:end])
        yield start, np.array(llm.scores[start:end], dtype=np.float32)


def scoring_windows(ids: list[int], n_ctx: int):
    """(window, targets) pairs: window w is scored in one pass; every token but the first is a target once."""
    for s in range(0, len(ids) - 1, n_ctx):
        window = ids[s: s + n_ctx]
        targets = np.array(ids[s + 1: s + len(window) + 1])
        yield window[: len(targets)], targets  # the last window: no target after the text's end


def scoring_bytes(n_ctx: int, n_vocab: int) -> int:
    """What scoring a window holds beside the model: its logits' float32 copy and one chunk's temporaries."""
    return 4 * n_ctx * n_vocab + 48 * ROWS_AT_ONCE * n_vocab


def compare_rows(ref_lp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> tuple[float, float, int, np.ndarray]:
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

    def first_windows(self, n_windows: int) -> "Reference":
        """The reference on its first n_windows windows only (fewer tokens to score a slow candidate on)."""
        n_windows = max(1, min(n_windows, len(self.log_probs)))
        log_probs = self.log_probs[:n_windows]
        n = sum(len(lp) for lp in log_probs)
        nll = self.window_nll[:n_windows]
        return Reference(self.ids[: n + 1], self.n_ctx, log_probs, math.exp(sum(nll) / n), self.store, nll)

    def release_pages(self) -> None:
        """Give back the pages of the table read so far: unmapped from this process, then dropped
        from the page cache (clean: read again when asked for). Mapped, they count as memory in use,
        and a candidate opened after them plans its cache without them (15 MB after one pass of the
        default's calibration: the second ladder measured under a tight cap found no room)."""
        mapping = getattr(self.log_probs[0], "_mmap", None)  # None: arrays on the heap
        if mapping is not None and self.store is not None:
            mapping.madvise(mmap.MADV_DONTNEED)
            os.posix_fadvise(self.store.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


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
        self.window_nll.append(nll_of_rows(logits[: len(targets)], targets, out=lp))
        self.log_probs.append(lp)
        self.row += len(targets)

    def finish(self) -> Reference:
        """The reference on the windows added (the first ones; at least one)."""
        if not self.log_probs:
            raise HobbitError("the reference has none of its windows")
        self.table.flush()
        # written: read back as scored, through a fresh mapping. The kernel keeps a page another
        # mapping still holds, so the writing one goes first, or what it wrote stays charged to the
        # process (22 MB of a 131 MB table under a 75 MB cap)
        shape, lengths = self.table.shape, [len(lp) for lp in self.log_probs]
        del self.table, self.log_probs
        os.posix_fadvise(self.store.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        table = np.memmap(self.store, dtype=np.float32, mode="r", shape=shape)
        starts = np.cumsum([0] + lengths)
        log_probs = [table[a:b] for a, b in zip(starts[:-1], starts[1:])]
        return Reference(self.ids[: self.row + 1], self.n_ctx, log_probs,
                         math.exp(sum(self.window_nll) / self.row), self.store, self.window_nll)

    def close(self) -> None:
        self.store.close()


@dataclass
class Comparison:
    """A candidate against a reference on the reference's windows (its first tokens where the
    comparison stopped early: `complete` False)."""

    n_tokens: int         # tokens scored
    perplexity: float     # the candidate's
    # mean KL(reference || candidate) per token, in nats; where stopped early, the KL summed over
    # the tokens scored divided by all the reference's tokens: the least the whole text can measure
    mean_kl: float
    top1_agreement: float  # share of positions where both pick the same next token
    # standard error of log(perplexity / reference perplexity), from the per-token differences
    # of the two negative log-likelihoods: how far the measured increase may be from the text's
    log_ppl_ratio_se: float | None
    reference_perplexity: float  # on the tokens scored
    complete: bool = True  # every window of the reference scored

    @property
    def ppl_increase(self) -> float:
        return self.perplexity / self.reference_perplexity - 1.0


def compare_to_reference(candidate, reference: Reference, progress=None,
                         stop_beyond: float | None = None) -> Comparison:
    """Run an open candidate model (logits_all, n_ctx of the reference's) over the reference's
    windows and compare. progress: wraps the (window, log-probabilities) pairs (a bar).
    stop_beyond: a mean KL; the tokens left are not scored once the KL summed so far exceeds it
    over every token of the reference (KL is never negative: the whole text would measure beyond
    it too, and a decision taken at that mean is the same), checked after each window and after
    the first window's first part (FIRST_PART)."""
    nll = kl = 0.0
    agree = n = 0
    diffs = []  # per token: candidate's negative log-likelihood minus the reference's
    n_total = len(reference.ids) - 1
    ref_nll = 0.0  # the reference's, on the tokens scored

    def sure_beyond() -> bool:
        return stop_beyond is not None and n < n_total and kl > stop_beyond * n_total

    pairs = list(zip(scoring_windows(reference.ids, reference.n_ctx), reference.log_probs))
    for w, ((window, targets), ref_lp) in enumerate(progress(pairs) if progress else pairs):
        cuts = [0, len(targets)]
        if stop_beyond is not None and w == 0 and len(targets) >= 2 * FIRST_PART:
            cuts.insert(1, len(targets) // FIRST_PART)
        for start, logits in window_logits_in_parts(candidate, window, cuts):
            rows = slice(start, start + len(logits))
            p_nll, p_kl, p_agree, p_diffs = compare_rows(ref_lp[rows], logits, targets[rows])
            nll, kl, agree, n = nll + p_nll, kl + p_kl, agree + p_agree, n + len(logits)
            ref_nll -= float(ref_lp[rows][np.arange(len(logits)), targets[rows]].sum())
            diffs.append(p_diffs)
            if sure_beyond():
                break
        reference.release_pages()  # one window mapped at a time, not the table
        if sure_beyond():
            break
    d = np.concatenate(diffs)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    complete = n == n_total
    ref_ppl = math.exp(ref_nll / n) if not complete else reference.perplexity
    return Comparison(n, math.exp(nll / n), kl / n_total, agree / n, se, ref_ppl, complete)
