"""The I/O thread runs under compute: prefetched experts arrive while the graph is
still computing, and prefetching changes no output bit."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from conftest import MB, fast_first, identical_companion, run_logits, tiny_model

# prefetch is what these tests measure: with memory to spare, auto mode would compute the
# (page-cached) experts in place and have nothing to prefetch
LOAD = "gpu-centric"


def test_prefetch_completes_while_compute_runs(model_dir):
    path = tiny_model(model_dir, "llama", n_layer=6)
    info = hobbitpy.inspect_model(path)
    budget_mb = info.expert_bytes_total / 2 / MB

    ref_scores, ref_text, _, _ = run_logits(path, hobbitpy.OffloadConfig(enabled=False))
    scores, text, _, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=budget_mb, prefetch_layers=1, mode=LOAD))
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text

    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=budget_mb, prefetch_layers=1, mode=LOAD),
                         n_ctx=256, verbose=False, n_threads=2)
    try:
        llm.create_completion("The old lighthouse keeper said", max_tokens=48, temperature=0.0)
        s = llm.offload_stats()
    finally:
        llm.close()
    assert s["prefetch_issued"] > 0
    # loads that finished while no layer waited and the graph was between two MoE
    # layers: the read overlapped the computation of the current layer
    assert s["loads_overlapped"] > 0, s
    assert s["prefetch_used"] > 0, s
    assert s["bytes_read"] == s["n_reads"] * info.expert_bytes
    assert s["peak_pool_bytes"] <= s["budget_bytes"]


@pytest.mark.parametrize("depth", [2, 4])
def test_adaptive_prefetch_is_exact_and_accounts_for_its_guesses(model_dir, depth):
    # HOBBIT §3.3: up to `depth` layers ahead, one layer deeper only while the
    # predictions so far are all cached; wrong queued guesses are dropped at their layer
    path = tiny_model(model_dir, "llama", n_layer=6)
    info = hobbitpy.inspect_model(path)
    ref_scores, ref_text, _, _ = run_logits(path, hobbitpy.OffloadConfig(enabled=False))
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total * 0.6 / MB, prefetch_layers=depth, mode=LOAD)
    scores, text, _, _ = run_logits(path, config)
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text

    with hobbitpy.Llama(path, offload=config, n_ctx=256, verbose=False, n_threads=2) as llm:
        llm.create_completion("The old lighthouse keeper said", max_tokens=48, temperature=0.0)
        s = llm.offload_stats()
    assert s["prefetch_issued"] > 0 and s["prefetch_used"] > 0
    # random routing: some guesses are wrong, and each is counted once at most
    assert s["prefetch_wasted"] > 0
    assert s["prefetch_used"] + s["prefetch_wasted"] <= s["prefetch_issued"]
    assert s["peak_pool_bytes"] <= s["budget_bytes"]


def test_prefetch_never_reads_an_expert_twice_when_all_fit(model_dir):
    # with room for every expert nothing is evicted: prefetching 4 layers deep must not
    # load anything already cached or loading, and predictions stop at the cached layers
    path = tiny_model(model_dir, "llama", n_layer=6)
    info = hobbitpy.inspect_model(path)
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / MB, prefetch_layers=4, mode=LOAD)
    with hobbitpy.Llama(path, offload=config, n_ctx=256, verbose=False, n_threads=2) as llm:
        llm.create_completion("The old lighthouse keeper said that the storms of the winter had never been so "
                              "fierce", max_tokens=32, temperature=0.0)
        s = llm.offload_stats()
    assert s["n_reads"] <= info.n_layer_moe * info.n_expert
    assert s["prefetch_issued"] > 0


def test_mixed_precision_prefetch_is_exact_with_identical_levels(model_dir):

    path = tiny_model(model_dir, "llama", n_layer=6)
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    info = hobbitpy.inspect_model(path)
    ref_scores, ref_text, _, _ = run_logits(path, hobbitpy.OffloadConfig(enabled=False))
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total * 0.6 / MB, prefetch_layers=2,
                                    low=str(low), t1=0.0, t2=1.0, policy="hobbit", mode=LOAD)
    scores, text, stats, _ = run_logits(path, config)
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["prefetch_issued"] > 0 and stats["served"][1] > 0


def test_widened_prefetch_is_exact_and_fetches_past_the_top_k(model_dir):
    # Fate §4.3: more candidates than the router's top-k per predicted layer; the extra loads
    # change no output bit and are counted like every guess
    path = tiny_model(model_dir, "llama", n_layer=6)
    info = hobbitpy.inspect_model(path)
    ref_scores, ref_text, _, _ = run_logits(path, hobbitpy.OffloadConfig(enabled=False))
    issued = {}
    for width in (0, info.n_expert_used + 2, -1):  # -1: Fate's rule, here k + 1
        config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total * 0.6 / MB, prefetch_layers=1,
                                        prefetch_width=width, mode=LOAD)
        scores, text, stats, _ = run_logits(path, config)
        assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
        assert text == ref_text
        assert stats["prefetch_used"] + stats["prefetch_wasted"] <= stats["prefetch_issued"]
        issued[width] = stats["prefetch_issued"]
    assert issued[info.n_expert_used + 2] > issued[-1] > issued[0]
    with pytest.raises(ValueError, match="prefetch_width"):
        hobbitpy.OffloadConfig(prefetch_width=-2)


@pytest.mark.parametrize("arch", fast_first(["llama", "qwen2moe", "gpt-oss"]))
def test_a_long_prompt_keeps_experts_from_one_ubatch_to_the_next(model_dir, arch):
    # a prompt of 4 ubatches, each selecting (nearly) every expert of every layer, through a
    # pool of 3 of the 4 layers' experts (the layer computing, the next one loading, one
    # more): a recency rule loads every expert again in every ubatch (the sweep evicts
    # exactly what comes next); taking slots from the layer the sweep reaches last keeps the
    # first layer's from one ubatch to the next. Q4_K experts are repacked, never in place.
    path = tiny_model(model_dir, arch, n_layer=4, expert_type="Q4_K", n_embd=256, n_ff=512)
    info = hobbitpy.inspect_model(path)
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total * 3 / 4 / MB, mode=LOAD)
    n_ubatch, n_pass = 32, 4

    def prompt_logits(offload):
        with hobbitpy.Llama(path, offload=offload, n_ctx=256, n_batch=256, n_ubatch=n_ubatch, logits_all=True,
                            verbose=False, n_threads=2) as llm:
            ids = llm.tokenize((PROMPT_TEXT * 8).encode())[: n_ubatch * n_pass]
            assert len(ids) == n_ubatch * n_pass
            llm.eval(ids)
            return np.array(llm.scores[: llm.n_tokens], np.float32), (llm.offload_stats() if offload.enabled else None)

    ref, _ = prompt_logits(hobbitpy.OffloadConfig(enabled=False))
    got, s = prompt_logits(config)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    loads = s["bytes_read"] // info.expert_bytes
    every_time = n_pass * info.n_expert * info.n_layer_moe
    assert loads <= 0.8 * every_time, (loads, every_time)
    assert s["peak_pool_bytes"] <= s["budget_bytes"]


PROMPT_TEXT = "The keeper climbed the stairs of the lighthouse at dusk and lit the great lamp above the sea. "
