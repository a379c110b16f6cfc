"""Cooperative mode (HOBBIT §4, Fiddler's Algorithm 1): a missed expert computed in place
on the model's mapped file instead of loaded. In place runs the model's own weights with
stock's kernels, so the logits stay bit-equal to stock whatever runs where."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from hobbitpy.settings.config import MODES
from hobbitpy.system.disk import drop_from_page_cache
from conftest import ARCHES, CONTINUATION, MB, PROMPT, identical_companion, reference, run_logits, tiny_model


@pytest.mark.parametrize("mode", ["cooperative", "auto", "balanced"])
@pytest.mark.parametrize("arch", ARCHES)
def test_in_place_is_bit_exact(model_dir, arch, mode):
    path = tiny_model(model_dir, arch)
    ref_scores, ref_text, _, info = reference(path)
    scores, text, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes * 2 / MB, mode=mode))
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["mode"] == MODES.index(mode)
    assert stats["expert_inplace"] > 0
    if mode == "cooperative":
        # nothing is loaded on demand: every miss ran on the mapped file
        assert stats["expert_misses"] == 0 and stats["bytes_read"] == 0


@pytest.mark.parametrize("arch", ARCHES)
def test_balanced_splits_misses_both_ways(model_dir, arch):
    """Algorithm 2's split: with the model's experts out of the page cache, a wave's misses
    are loaded (the widest batches) and computed in place (the narrowest), and the logits
    stay stock's. (Loaded, this tiny model's file is in the page cache whole, and an expert
    the page cache holds runs in place for free: it is dropped after the load.)"""
    path = tiny_model(model_dir, arch)
    ref_scores, _, _, info = reference(path)
    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes * 2 / MB, mode="balanced"),
                         n_ctx=256, n_batch=256, logits_all=True, verbose=False, n_threads=2, n_threads_batch=2)
    try:
        drop_from_page_cache(path)
        llm.eval(llm.tokenize(PROMPT.encode()))
        for t in llm.tokenize(CONTINUATION.encode(), add_bos=False)[:10]:
            llm.eval([t])
        scores = np.array(llm.scores[: llm.n_tokens], dtype=np.float32, copy=True)
        stats = llm.offload_stats()
    finally:
        llm.close()
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert stats["mode"] == MODES.index("balanced")
    assert stats["expert_inplace"] > 0 and stats["expert_misses"] > 0 and stats["bytes_read"] > 0


def test_cooperative_with_prefetch_and_mixed_precision(model_dir):

    path = tiny_model(model_dir, "llama", n_layer=6)
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    ref_scores, ref_text, _, info = reference(path)
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, mode="cooperative", prefetch_layers=2,
                                    low=str(low), t1=0.0, t2=1.0, policy="hobbit")
    scores, text, stats, _ = run_logits(path, config)
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    # the cache still fills: by prefetch and by the warm-up of the low level
    assert stats["expert_hits"] > 0 and stats["warm_loads"] > 0


def test_auto_measures_its_latency_model(model_dir):
    path = tiny_model(model_dir, "llama")
    info = hobbitpy.inspect_model(path)
    with hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes * 2 / MB, mode="auto"), n_ctx=64,
                        verbose=False) as llm:
        s = llm.offload_stats()
    assert s["mode"] == 2 and s["load_bytes_per_s"] > 0 and s["map_bytes_per_s"] > 0


def test_repacked_experts_fall_back_to_loading(model_dir):
    # Q4_K experts are repacked for the CPU's kernels: the mapped file would compute with
    # other kernels than stock, so cooperative mode loads them (and says so)
    path = tiny_model(model_dir, "llama", expert_type="Q4_K", n_embd=256, n_ff=512)
    ref_scores, _, _, info = reference(path)
    scores, _, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB,
                                                                  mode="cooperative"))
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert stats["mode"] == 0 and stats["expert_inplace"] == 0 and stats["expert_misses"] > 0


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        hobbitpy.OffloadConfig(mode="gpu")
