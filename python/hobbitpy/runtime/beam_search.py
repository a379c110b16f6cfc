"""Beam search over one context: the beams are sequences of the same KV cache, decoded side
by side, one token each per step, in one batch (Fiddler §5's beam-search case: a step's
batch selects the union of its beams' experts, so an expert cache serves them together).

The same code runs stock llama.cpp (a Llama without offload) and hobbitpy, so their beam
searches compare like for like: with one precision they find the same beams, bit for bit.
The Llama must be made with ``n_seq_max >= width`` (the beams' sequences); the prompt is
decoded once, as sequence 0, and shared with every beam (llama_memory_seq_cp on a unified
KV cache copies no data).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import llama_cpp

from ..errors import HobbitError
from ..analysis.likelihood import log_softmax

MAX_WIDTH = 8  # the range, 2-8; more would only widen the batch


@dataclass
class Beam:
    tokens: list[int]
    logprob: float  # the sum of the tokens' log probabilities
    seq: int        # the KV cache sequence holding its context


@dataclass
class BeamResult:
    tokens: list[int]          # the best beam's tokens (the prompt not included)
    logprob: float
    steps: int                 # decode calls after the prompt, one batch of every live beam each
    step_seconds: float        # the time those took (the prompt's decode not included)
    beams: list[Beam]          # every beam at the end, best first


def _best(logprobs: np.ndarray, n: int) -> np.ndarray:
    """The n most probable token ids, most probable first; ties to the lower id (deterministic)."""
    top = np.argpartition(-logprobs, n - 1)[:n]
    return top[np.lexsort((top, -logprobs[top]))]


def beam_search(llm, prompt: list[int], width: int, n_predict: int) -> BeamResult:
    """Extend prompt by n_predict tokens with a beam search of `width` beams (the sum of log
    probabilities; a beam that ends with end-of-generation is kept as finished, the others
    go on). llm: a hobbitpy.Llama (or llama_cpp.Llama) whose context has n_seq_max >= width."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"beam width must be 1..{MAX_WIDTH}, got {width}")
    if n_predict < 1 or not prompt:
        raise ValueError("beam search needs a prompt and at least one token to predict")
    ctx = llm._ctx.ctx
    n_seq_max = llama_cpp.llama_n_seq_max(ctx)
    if n_seq_max < width:
        raise HobbitError(f"a beam search of width {width} needs a context of {width} sequences; this one has "
                          f"{n_seq_max} (make the Llama with n_seq_max={width})")
    if len(prompt) + width * n_predict > llm.n_ctx():  # each beam's tokens take cells of their own
        raise HobbitError(f"{len(prompt)} prompt tokens and {n_predict} more for each of {width} beams do not fit "
                          f"the context of {llm.n_ctx()} tokens")
    memory = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_clear(memory, True)
    llm.n_tokens = 0  # llama_cpp's own record of the context no longer holds
    n_vocab = llm.n_vocab()
    vocab = llm._model.vocab
    batch = llama_cpp.llama_batch_init(max(len(prompt), width), 0, 1)
    try:
        def decode(entries: list[tuple[int, int, int]], every_row: bool) -> list[np.ndarray]:
            """Decode (token, position, sequence) entries in one batch; the logits of every
            entry, or of the last one only (the prompt)."""
            batch.n_tokens = len(entries)
            for i, (tok, pos, seq) in enumerate(entries):
                batch.token[i], batch.pos[i] = tok, pos
                batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
                batch.logits[i] = every_row or i == len(entries) - 1
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                error = HobbitError(f"llama_decode failed ({rc}) in the beam search")
                if hasattr(llm, "_raise_read_error"):
                    llm._raise_read_error(error)  # an expert read that failed says so
                raise error
            rows = range(len(entries)) if every_row else [len(entries) - 1]
            return [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                    for i in rows]

        first = log_softmax(decode([(t, i, 0) for i, t in enumerate(prompt)], every_row=False)[0])
        live = [Beam([int(t)], float(first[t]), seq=0) for t in _best(first, width)]
        for b, beam in enumerate(live[1:], start=1):  # every beam shares the prompt's cells
            beam.seq = b
            llama_cpp.llama_memory_seq_cp(memory, 0, b, -1, -1)
        finished: list[Beam] = []
        steps = 0
        t0 = time.perf_counter()
        for _ in range(n_predict - 1):
            finished += [b for b in live if llama_cpp.llama_vocab_is_eog(vocab, b.tokens[-1])]
            live = [b for b in live if not llama_cpp.llama_vocab_is_eog(vocab, b.tokens[-1])]
            if not live:
                break
            logits = decode([(b.tokens[-1], len(prompt) + len(b.tokens) - 1, b.seq) for b in live], every_row=True)
            steps += 1
            candidates = []  # (logprob, beam index, token): each beam's best `width` continuations
            for i, (beam, row) in enumerate(zip(live, logits)):
                lp = log_softmax(row)
                candidates += [(beam.logprob + float(lp[t]), i, int(t)) for t in _best(lp, len(live))]
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            chosen = candidates[:len(live)]
            # a parent's first child keeps its sequence; each further child takes the sequence
            # of a beam that has none, emptied and given the parent's cells
            children = [sum(1 for c in chosen if c[1] == i) for i in range(len(live))]
            spare = [live[i].seq for i in range(len(live)) if children[i] == 0]
            taken = [False] * len(live)
            nxt = []
            for lp, i, tok in chosen:
                parent = live[i]
                if not taken[i]:
                    taken[i] = True
                    seq = parent.seq
                else:
                    seq = spare.pop()
                    llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
                    llama_cpp.llama_memory_seq_cp(memory, parent.seq, seq, -1, -1)
                nxt.append(Beam(parent.tokens + [tok], lp, seq))
            for seq in spare:  # beams that died without children
                llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
            live = nxt
        step_seconds = time.perf_counter() - t0
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_memory_clear(memory, True)  # the beams' cells go: the context is empty, as llm.n_tokens says
    beams = sorted(finished + live, key=lambda b: -b.logprob)
    return BeamResult(tokens=beams[0].tokens, logprob=beams[0].logprob, steps=steps, step_seconds=step_seconds,
                      beams=beams)
