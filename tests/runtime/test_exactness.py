"""With one precision, offloaded logits equal stock llama.cpp's bit for bit, at any
cache size, for every MoE variant build_moe_ffn handles; and the cache accounts for
exactly what it did."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from conftest import (ARCHES, BUDGETS, MB, assert_bit_equal, fast_first, identical_companion, prompt_logits,
                      reference, run_logits, tiny_model)
from hobbitpy.files.model_file import layer_expert_bytes
from hobbitpy.files.synthetic_moe import EXPERT_TYPES

# these tests check the pool path: every missed expert is loaded (the cooperative and auto
# modes, which may compute it in place instead, have their own tests in test_cooperative.py)
POOL = "gpu-centric"


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("arch", ARCHES)
def test_offloaded_logits_equal_stock(model_dir, arch, budget):
    path = tiny_model(model_dir, arch)
    ref_scores, ref_text, ref_stats, info = reference(path)
    assert not ref_stats["offloaded"]  # the reference really ran without the runtime

    budget_bytes = BUDGETS[budget](info)
    scores, text, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=budget_bytes / MB, mode=POOL))

    assert np.isfinite(ref_scores).all()
    assert scores.shape == ref_scores.shape
    # bit for bit, not approximately
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text

    assert stats["expert_misses"] > 0
    assert stats["peak_pool_bytes"] <= stats["budget_bytes"]
    assert stats["pool_bytes"] <= budget_bytes
    # every byte read is a whole expert: a miss loaded on demand, or one of the next
    # layer's experts loaded while a prompt's layer computes (no decode prefetch asked for)
    assert stats["bytes_read"] == stats["n_reads"] * info.expert_bytes
    assert stats["demand_bytes_read"] == stats["expert_misses"] * info.expert_bytes
    assert stats["n_reads"] <= stats["expert_misses"] + stats["prefetch_issued"]
    if budget == "min":
        assert stats["expert_inplace"] > 0, "a prompt wider than the pool must run some experts in place"
    if budget == "all":
        # every expert fits: each is read at most once
        assert stats["expert_misses"] <= info.n_layer_moe * info.n_expert
        assert stats["expert_inplace"] == 0


@pytest.mark.parametrize("n_threads", [1, 2])
def test_exact_with_thread_counts_and_more_experts(model_dir, n_threads):
    # 16 experts, top-4: a different routing width and a thread count of 1
    path = tiny_model(model_dir, "llama", n_expert=16, n_expert_used=4)
    ref_scores, ref_text, _, info = run_logits(path, hobbitpy.OffloadConfig(enabled=False), n_threads=n_threads)
    scores, text, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 3 / MB, mode=POOL),
                                        n_threads=n_threads)
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["expert_hits"] > 0 and stats["expert_misses"] > 0


def test_offload_does_not_read_experts_at_load(model_dir):
    path = tiny_model(model_dir, "llama")
    info = hobbitpy.inspect_model(path)
    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, mode=POOL),
                         n_ctx=64, verbose=False)
    try:
        stats = llm.offload_stats()
        assert stats["bytes_read"] == 0 and stats["peak_pool_bytes"] == 0
        assert stats["n_slot"] == (info.expert_bytes_total // 2) // info.expert_bytes
    finally:
        llm.close()


@pytest.mark.parametrize("budget", ["min", "half"])
def test_mixed_expert_types_get_one_pool_each(model_dir, budget):
    # odd layers keep their down projection in F16, even ones in Q8_0 (like Q4_K_M's
    # Q6_K / Q4_K mix): two expert signatures, two pools, still bit-exact
    path = tiny_model(model_dir, "qwen2moe", down_type_odd_layers="F16")
    ref_scores, ref_text, _, info = reference(path)
    assert not info.uniform
    budget_bytes = BUDGETS[budget](info)
    scores, text, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=budget_bytes / MB, mode=POOL))
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["expert_misses"] > 0
    assert stats["peak_pool_bytes"] <= stats["pool_bytes"] <= budget_bytes
    assert stats["n_slot"] >= 2 * info.n_expert_used  # every pool holds a token's top-k


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("arch", fast_first(["llama", "gpt-oss"]))
def test_types_the_cpu_repacks_stay_exact(model_dir, arch, budget):
    # stock llama.cpp repacks Q4_K experts for its AVX2 kernels (CPU_REPACK buffer); the
    # pool uses the same buffer type, so the same kernels and the same bits. Such experts
    # cannot run in place on the mapped file, so a prompt wider than the pool runs in
    # waves (gpt-oss: with per-expert biases added in every wave)
    path = tiny_model(model_dir, arch, expert_type="Q4_K", n_embd=256, n_ff=512)
    ref_scores, ref_text, _, info = reference(path)
    budget_bytes = BUDGETS[budget](info)
    scores, text, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=budget_bytes / MB, mode=POOL))
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["expert_misses"] > 0 and stats["expert_inplace"] == 0
    assert stats["demand_bytes_read"] == stats["expert_misses"] * info.expert_bytes


@pytest.mark.parametrize("expert_type", ["Q4_K", "Q4_0"])
def test_types_the_cpu_repacks_stay_exact_without_repacking(model_dir, expert_type):
    # under a memory cap stock's best setting is --no-repack (run_plan.repack_fits): its experts
    # then compute from plain memory with the generic kernels, and so do the pools'. Plain
    # experts may also run in place, so a prompt wider than the pool needs no waves
    path = tiny_model(model_dir, "llama", expert_type=expert_type, n_embd=256, n_ff=512)
    info = hobbitpy.inspect_model(path)
    # (with AVX2 the repacked run's bits differ from it: other kernels)
    ref_scores, _ = prompt_logits(path, hobbitpy.OffloadConfig(enabled=False), repack=False)
    for mode in (POOL, "cooperative"):
        scores, stats = prompt_logits(path, hobbitpy.OffloadConfig(cache_mb=BUDGETS["min+1"](info) / MB, mode=mode),
                                      repack=False)
        assert_bit_equal(scores, ref_scores)
        assert stats["expert_misses"] + stats["expert_inplace"] > 0
    assert stats["expert_inplace"] > 0  # cooperative: in place on the mapped file, which a repacked pool forbids


# the README's run has one type of each family and those the CPU repacks; the slow run the
# rest (among them the IQ types whose quantization searches take seconds a tensor)
FAST_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4", "BF16")


@pytest.mark.parametrize("expert_type", [t if t in FAST_TYPES else pytest.param(t, marks=pytest.mark.slow)
                                         for t in EXPERT_TYPES])
def test_every_expert_type_is_exact_at_a_tight_budget(model_dir, expert_type):
    """The expert types of the files users download (k-quants, the IQ family, MXFP4, BF16,
    the types the CPU repacks), quantized by ggml's own quantizer: one slot over the minimum
    budget, so nearly every selection is a miss, bit-exact to stock."""
    arch = "gpt-oss" if expert_type == "MXFP4" else "llama"  # gpt-oss publishes its experts in MXFP4
    path = tiny_model(model_dir, arch, expert_type=expert_type, n_embd=256, n_layer=2, n_expert=4)
    info = hobbitpy.inspect_model(path)
    ref_scores, _ = prompt_logits(path, hobbitpy.OffloadConfig(enabled=False))
    scores, stats = prompt_logits(path, hobbitpy.OffloadConfig(cache_mb=BUDGETS["min+1"](info) / MB, mode=POOL))
    assert_bit_equal(scores, ref_scores)
    assert stats["expert_misses"] > 0
    assert stats["demand_bytes_read"] <= stats["bytes_read"] == stats["n_reads"] * info.expert_bytes


# a "dynamic" quant: each layer's experts in another type, down projections a step apart
MIXED_TYPES = dict(layer_types=("Q4_K", "IQ3_S", "Q6_K", "IQ4_XS"), down_type_odd_layers="Q5_K", n_embd=256)


@pytest.mark.parametrize("budget", ["min", pytest.param("half", marks=pytest.mark.slow)])
def test_a_file_whose_layers_mix_expert_types_is_exact_with_one_level_and_two(model_dir, budget):
    """Pools per signature, budgets in the bytes of the types actually stored: bit-exact to
    stock with the model's own experts, and with a second level of byte-identical copies
    (the companion is as mixed as the model)."""
    path = tiny_model(model_dir, "llama", **MIXED_TYPES)
    ref_scores, ref_text, _, info = reference(path)
    assert not info.uniform and len(set(layer_expert_bytes(path).tolist())) == len(MIXED_TYPES["layer_types"])
    budget_bytes = max(BUDGETS[budget](info), info.min_budget_bytes)
    scores, text, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=budget_bytes / MB, mode=POOL))
    assert_bit_equal(scores, ref_scores)
    assert text == ref_text and stats["expert_misses"] > 0
    assert stats["peak_pool_bytes"] <= stats["pool_bytes"] <= budget_bytes
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    config = hobbitpy.OffloadConfig(cache_mb=2 * budget_bytes / MB, low=str(low), t1=0.0, t2=1.0, mode=POOL)
    scores, text, stats, _ = run_logits(path, config)
    assert_bit_equal(scores, ref_scores)
    assert stats["served"][0] > 0 and stats["served"][1] > 0, stats["served"]



def test_the_defaults_cache_policy_is_exact(model_dir):
    # the frequency policy with a profile as its prior (the default's, the calibration's importance):
    # the pools warmed in the profile's order, then its own counts; one precision, stock's bits
    path = tiny_model(model_dir, "llama", n_expert=16, n_expert_used=4)
    ref_scores, ref_text, _, info = reference(path)
    profile = np.random.default_rng(3).gamma(0.5, size=(info.n_layer_moe, info.n_expert))
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 3 / MB, mode=POOL, policy="frequency",
                                    popularity=tuple(map(tuple, profile.tolist())))
    scores, text, stats, _ = run_logits(path, config)
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["warm_loads"] > 0 and stats["expert_hits"] > 0 and stats["expert_misses"] > 0, stats


def test_a_deep_model_in_many_waves_a_layer_is_exact(model_dir):
    """A ubatch wider than a layer's pools runs in waves, each a dispatch op and its own passes
    through the expert matmuls (per pool and in place); on a deep model the graph's context must
    have room for every wave of every layer (it had room for stock's graph only, and ggml
    aborted the process: 32 layers, two levels, ubatches of 256 tokens). With a byte-identical
    second level, still stock's bits."""
    path = tiny_model(model_dir, "llama", n_layer=32)
    ref_scores, ref_text, _, info = reference(path)
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    per_expert = info.expert_bytes_total / (info.n_layer_moe * info.n_expert)
    config = hobbitpy.OffloadConfig(cache_mb=8 * per_expert / MB, low=str(low), t1=0.5, t2=1.0, hits="exact", mode=POOL)
    scores, text, stats, _ = run_logits(path, config)
    assert_bit_equal(scores, ref_scores)
    assert text == ref_text and stats["served"][0] > 0 and stats["served"][1] > 0, stats["served"]
