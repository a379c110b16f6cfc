"""Mixed precision (HOBBIT §3.2): companion files as precision levels, one pool and one
mul_mat_id pass per level, the eq. 2 score choosing high / low / skip per missed selection.

The plumbing is checked exactly: a companion holding byte-identical copies of the
model's experts must leave the logits bit-equal to stock, whichever level serves each
selection, because each pass adds exact zero rows for the pairs it does not serve."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from conftest import (ARCHES, CONTINUATION, MB, PROMPT, assert_bit_equal, identical_companion, reference, run_logits,
                      session_copy, tiny_model)


@pytest.mark.parametrize("arch", ARCHES)
def test_two_levels_of_identical_experts_are_bit_exact(model_dir, arch):
    path = tiny_model(model_dir, arch)
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    ref_scores, ref_text, _, info = reference(path)
    # t1 = 0: every selection but each token's first wants the low level; t2 = 1: none skipped
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, low=str(low), t1=0.0, t2=1.0)
    scores, text, stats, _ = run_logits(path, config)
    assert_bit_equal(scores, ref_scores)
    assert text == ref_text
    assert stats["n_level"] == 2
    assert stats["served"][0] > 0 and stats["served"][1] > 0, stats["served"]
    assert stats["n_skipped"] == 0


def test_three_levels_at_the_minimum_budget_are_bit_exact(model_dir):
    # the smallest budget: a prompt wider than the pools runs partly in place
    path = tiny_model(model_dir, "llama", n_expert=16, n_expert_used=4)
    mid = identical_companion(path, model_dir / f"{path.stem}.mid.gguf")
    low = identical_companion(path, model_dir / f"{path.stem}.low.gguf")
    ref_scores, ref_text, _, info = reference(path)
    config = hobbitpy.OffloadConfig(cache_mb=3 * info.min_budget_bytes / MB, mid=str(mid), low=str(low), mode="gpu-centric",
                                    t1=0.0, t_mid=0.3, t2=1.0)
    scores, text, stats, _ = run_logits(path, config)
    assert_bit_equal(scores, ref_scores)
    assert text == ref_text
    assert all(n > 0 for n in stats["served"]), stats["served"]
    assert stats["expert_inplace"] > 0


def test_pool_stats_per_level(model_dir):
    path = tiny_model(model_dir, "llama")
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    info = hobbitpy.inspect_model(path)
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, low=str(low), t1=0.0, t2=1.0,
                                    level_shares=(3.0, 1.0))
    with hobbitpy.Llama(path, offload=config, n_ctx=128, verbose=False) as llm:
        llm.create_completion("Once upon a time", max_tokens=8, temperature=0.0)
        pools = llm.pool_stats()
        stats = llm.offload_stats()
        # one decode step: each of its selections is served at one level or skipped
        llm.reset_offload_stats()
        llm.eval([llm.tokenize(b" sea", add_bos=False)[0]])
        step = llm.offload_stats()
    assert [p["level"] for p in pools] == [0, 1]
    assert all(p["type"] == "Q8_0" for p in pools)
    # the budget above the minimum splits 3:1
    assert pools[0]["n_slot"] > pools[1]["n_slot"]
    assert sum(p["n_slot"] * p["expert_bytes"] for p in pools) <= stats["budget_bytes"]
    assert sum(p["bytes_read"] for p in pools) == stats["bytes_read"]
    assert sum(p["hits"] for p in pools) == stats["expert_hits"]
    assert sum(step["served"]) + step["n_skipped"] == info.n_expert_used * info.n_layer_moe


def test_skipping_drops_unimportant_misses(model_dir):
    path = tiny_model(model_dir, "llama")
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    ref_scores, _, _, info = reference(path)
    # t2 = 0: every missed selection but each token's first is skipped
    config = hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes * 2 / MB, low=str(low), t1=0.0, t2=0.0)
    scores, _, stats, _ = run_logits(path, config)
    assert stats["n_skipped"] > 0
    assert np.isfinite(scores).all()
    assert not np.array_equal(scores, ref_scores)


def test_skip_cached_leaves_out_resident_experts_too(model_dir):
    # skip_cached: a selection scoring above T2 is skipped whether its expert is in memory or
    # not, so what is skipped depends on the text alone: a cache of every expert gives the bits
    # of the smallest cache. t2 = 0 leaves each decoded token its first expert only
    path = tiny_model(model_dir, "llama")
    ref_scores, _, _, info = reference(path)
    skipping = dict(skip_cached=True, t1=0.0, t2=0.0, mode="gpu-centric")
    every, _, _, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / MB, **skipping))
    smallest, _, _, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes / MB, **skipping))
    assert_bit_equal(every, smallest)
    assert not np.array_equal(every, ref_scores)
    with hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / MB, **skipping),
                        n_ctx=128, verbose=False) as llm:
        llm.eval(llm.tokenize(PROMPT.encode()))
        llm.reset_offload_stats()
        decode = llm.tokenize(CONTINUATION.encode(), add_bos=False)[:10]
        for t in decode:
            llm.eval([t])
        step = llm.offload_stats()
    n_steps = len(decode)
    # every decode step: one expert per layer served, the other k - 1 skipped, resident or not
    assert step["n_skipped"] == n_steps * info.n_layer_moe * (info.n_expert_used - 1)
    assert sum(step["served"]) == n_steps * info.n_layer_moe
    assert step["expert_hits"] > 0
    # nothing scores above t2 = 1: stock's bits, resident experts and all
    kept, _, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / MB,
                                                               skip_cached=True, t2=1.0))
    assert_bit_equal(kept, ref_scores)
    assert stats["n_skipped"] == 0


def test_one_level_ignores_thresholds(model_dir):
    # thresholds only act between levels: with one precision nothing is skipped and stock is matched
    path = tiny_model(model_dir, "llama")
    ref_scores, _, _, info = reference(path)
    scores, _, stats, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=info.min_budget_bytes / MB, t1=0.0, t2=0.0))
    assert_bit_equal(scores, ref_scores)
    assert stats["n_skipped"] == 0 and stats["n_level"] == 1


def test_companion_of_another_model_is_refused(model_dir):
    path = tiny_model(model_dir, "llama")
    other = tiny_model(model_dir, "llama", n_ff=128)
    wrong = identical_companion(other, model_dir / f"{other.stem}.copy.gguf")
    with pytest.raises(hobbitpy.HobbitError) as e:
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=64, low=str(wrong)), n_ctx=64, verbose=False)
    assert str(path) in str(e.value) and str(wrong) in str(e.value) and "shape" in str(e.value)

    broken = identical_companion(path, model_dir / f"{path.stem}.broken.gguf", drop="blk.1.ffn_gate_exps.weight")
    with pytest.raises(hobbitpy.HobbitError) as e:
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=64, low=str(broken)), n_ctx=64, verbose=False)
    assert "blk.1.ffn_gate_exps.weight" in str(e.value) and "missing" in str(e.value) and str(broken) in str(e.value)


def test_missing_companions_get_clear_errors(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama")
    with pytest.raises(hobbitpy.ModelFileError) as e:
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=64, low=str(tmp_path / "nope.gguf")), verbose=False)
    assert "nope.gguf" in str(e.value) and "--low" in str(e.value)
    # a type name means the file `hobbitpy prepare` writes next to the model
    with pytest.raises(hobbitpy.ModelFileError) as e:
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=64, low="q3_k"), verbose=False)
    assert "Q3_K" in str(e.value) and "hobbitpy prepare" in str(e.value)


def test_budget_must_hold_every_level(model_dir):
    path = tiny_model(model_dir, "llama")
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    info = hobbitpy.inspect_model(path)
    with pytest.raises(hobbitpy.BudgetError) as e:
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=1.5 * info.min_budget_bytes / MB, low=str(low)),
                       verbose=False)
    assert "2 precisions" in str(e.value)


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="t1 <= t2"):
        hobbitpy.OffloadConfig(low="Q2_K", t1=0.9, t2=0.5)
    with pytest.raises(ValueError, match="low"):
        hobbitpy.OffloadConfig(mid="Q4_K")
    with pytest.raises(ValueError, match="level_shares"):
        hobbitpy.OffloadConfig(low="Q2_K", level_shares=(1.0,))


def test_default_split_keeps_every_expert_at_low_precision(model_dir):
    # by default the lowest level gets room for a copy of every expert and fills it in the
    # background (then the free slots above it): once warm, a decode finds every selection
    # in memory at some precision
    path = tiny_model(model_dir, "llama")
    low = session_copy(path, "Q4_0")
    info = hobbitpy.inspect_model(path)
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total * 0.8 / MB, low=str(low), mode="gpu-centric")
    with hobbitpy.Llama(path, offload=config, n_ctx=128, verbose=False) as llm:
        pools = llm.pool_stats()
        assert pools[1]["n_slot"] == info.n_layer_moe * info.n_expert
        llm.create_completion("Once upon a time", max_tokens=4, temperature=0.0)
        # every expert at low precision, then the high level's slots (all free at start)
        assert llm.offload_stats()["warm_loads"] == info.n_layer_moe * info.n_expert + pools[0]["n_slot"]
        llm.reset_offload_stats()
        llm.create_completion(" in a land far away", max_tokens=8, temperature=0.0)
        s = llm.offload_stats()
    assert s["expert_misses"] == 0 and s["demand_bytes_read"] == 0
    assert s["expert_hits"] > 0 and s["served"][1] > 0


def test_exact_hits_serve_the_wanted_level_at_any_budget(model_dir):
    # hits "exact" serves every selection at the level its score asks for: what is served,
    # and so the output, depends on the text alone, not on what the cache holds. High pools
    # of a few slots (every low copy resident, room for about five high ones) give the same
    # tokens as a cache that holds every copy; a miss with no room at its level was once
    # served lower, by which slots loads and predictions held (the first token differed)
    path = tiny_model(model_dir, "llama", n_embd=256, n_ff=1024, n_expert=32)
    low = session_copy(path, "Q2_K")
    info, low_info = hobbitpy.inspect_model(path), hobbitpy.inspect_model(low)
    high_expert = info.expert_bytes_total / (info.n_layer_moe * info.n_expert)
    runs = []
    for cache_bytes in (low_info.expert_bytes_total + 5 * high_expert, info.expert_bytes_total + low_info.expert_bytes_total):
        with hobbitpy.Llama(path, low=str(low), hits="exact", prefetch_layers=1, cache_mb=cache_bytes / MB, n_ctx=400,
                            n_threads=2, verbose=False) as llm:
            prompt = llm.tokenize(b"Once upon a time")
            tokens = []
            for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(t)
                if len(tokens) == 60:
                    break
            runs.append((tokens, llm.offload_stats()))
    (small, small_stats), (every, every_stats) = runs
    assert small_stats["expert_misses"] > every_stats["expert_misses"]
    assert every_stats["served"][0] > 0 and every_stats["served"][1] > 0, every_stats["served"]
    assert small == every
    assert small_stats["served"] == every_stats["served"] and small_stats["n_skipped"] == every_stats["n_skipped"]


def test_exact_hits_serve_a_prompt_level_by_level_as_decode_does(model_dir):
    """Hits "exact" over several levels serves a ubatch of several tokens level by level: each
    token's selection at the level its own score asks for, as decode serves it (one wave would
    serve an expert at the highest level any of its tokens wants), so the rule can be priced on a
    prompt-shaped pass. With an identical copy as the low level, stock's logits bit for bit (each
    level's waves add exact zero rows for the pairs they leave out); with a Q2_K copy, the text
    evaluated in one batch serves as many pairs at each level as its tokens evaluated one by one."""
    path = tiny_model(model_dir, "llama")
    same = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    ref_scores, ref_text, _, info = reference(path)
    both = 2.5 * info.expert_bytes_total / MB  # every expert at both levels: no level short of room
    config = hobbitpy.OffloadConfig(cache_mb=both, low=str(same), hits="exact", t1=0.0, t2=1.0, warm=False)
    scores, text, stats, _ = run_logits(path, config)
    assert_bit_equal(scores, ref_scores)
    assert text == ref_text and stats["served"][1] > 0, stats["served"]

    low = session_copy(path, "Q2_K")
    served = []
    for one_by_one in (False, True):
        # (every token's logits: llama.cpp's last layer otherwise computes only the tokens whose are wanted)
        with hobbitpy.Llama(path, low=str(low), hits="exact", t2=1.0, warm=False, cache_mb=both, n_ctx=256,
                            n_batch=256, logits_all=True, n_threads=2, verbose=False) as llm:
            ids = llm.tokenize((PROMPT + CONTINUATION).encode())
            for batch in ([[t] for t in ids] if one_by_one else [ids]):
                llm.eval(batch)
            served.append(llm.offload_stats()["served"])
    # (a batch's router weights are not bit for bit decode's: a pair scored at T1 may fall either side)
    (batch_high, batch_low), (one_high, one_low) = served
    assert batch_high + batch_low == one_high + one_low, served
    assert abs(batch_low - one_low) <= 0.02 * (one_high + one_low), served


def test_at_least_hits_never_serve_below_the_wanted_level(model_dir):
    """Hits "at-least" (HOBBIT's dynamic loading with the model's precision kept for every hit):
    a cached copy serves a selection only at its wanted precision or a higher one, and a miss
    loads the wanted one. With T1 = 1 every selection wants the model's precision: though the
    warm-up fills the low pool with a Q2_K copy of every expert, at-least gives stock's logits
    bit for bit, where "found" serves those copies. Wanting low (T1 = 0), a cached high copy
    still serves: fewer selections low than "exact" serves on the same tokens."""
    path = tiny_model(model_dir, "llama", n_embd=256, n_ff=1024, n_expert=32)
    low = session_copy(path, "Q2_K")
    info, low_info = hobbitpy.inspect_model(path), hobbitpy.inspect_model(low)
    ref_scores, _, _, _ = reference(path)
    high_expert = info.expert_bytes_total / (info.n_layer_moe * info.n_expert)
    # every low copy and half the high ones: a prompt's layer finds room at the high level (where this very
    # ubatch holds every high slot, a selection is served lower, with "exact" too)
    cache_mb = (low_info.expert_bytes_total + 64 * high_expert) / MB

    def run(hits, t1):
        return run_logits(path, hobbitpy.OffloadConfig(cache_mb=cache_mb, low=str(low), hits=hits, t1=t1, t2=1.0,
                                                       mode="gpu-centric", policy="lru"))

    scores, _, stats, _ = run("at-least", 1.0)
    assert_bit_equal(scores, ref_scores)
    assert stats["served"][1] == 0 and stats["expert_misses"] > 0, stats
    scores, _, stats, _ = run("found", 1.0)
    assert stats["served"][1] > 0, stats
    assert not np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))

    _, _, at_least, _ = run("at-least", 0.0)
    _, _, exact, _ = run("exact", 0.0)
    assert 0 < at_least["served"][1] < exact["served"][1], (at_least["served"], exact["served"])
    assert at_least["served"][0] > exact["served"][0]


# (gpu-centric with upgrade and balanced, the same rule over the others' paths: in the slow run)
@pytest.mark.parametrize("mode,hits", [("cooperative", "upgrade"), pytest.param("gpu-centric", "upgrade", marks=pytest.mark.slow),
                                       ("gpu-centric", "found"), ("auto", "upgrade"),
                                       pytest.param("balanced", "upgrade", marks=pytest.mark.slow)])
def test_the_same_text_gives_the_same_logits_whatever_the_disks_timing(model_dir, mode, hits):
    """At temperature 0 the same prompt gives the same logits, bit for bit, with a low copy
    that serves hits (and upgrades them) and prefetch on: what the cache holds is decided by
    the text, not by when the disk delivers. The reader threads change the timing from run to
    run (one reader, or four); with upgrades gated on the disk being idle and slots still
    loading counted as unavailable, two runs of the shipped model gave different text. Auto and
    balanced choose by timings, so they serve hits at the wanted precision only."""
    path = tiny_model(model_dir, "llama", n_embd=256, n_ff=1024, n_expert=32)
    low = session_copy(path, "Q2_K")
    info, low_info = hobbitpy.inspect_model(path), hobbitpy.inspect_model(low)
    high_expert = info.expert_bytes_total / (info.n_layer_moe * info.n_expert)
    cache_mb = (low_info.expert_bytes_total / 2 + 8 * high_expert) / MB  # both levels miss
    runs = []
    for io_threads in (1, 4, 1, 2):
        with hobbitpy.Llama(path, low=str(low), hits=hits, mode=mode, prefetch_layers=1, cache_mb=cache_mb,
                            io_threads=io_threads, n_ctx=256, n_threads=2, logits_all=True, verbose=False) as llm:
            llm.eval(llm.tokenize(b"Once upon a time"))
            for _ in range(96):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
            runs.append((np.array(llm.scores[: llm.n_tokens], np.float32), llm.offload_stats()))
    first, stats = runs[0]
    assert stats["served"][0] > 0 and stats["served"][1] > 0, stats
    if mode == "gpu-centric":
        assert stats["expert_misses"] > 0, stats
    if hits == "upgrade" and mode not in ("auto", "balanced"):
        assert stats["upgrades"] > 0, stats
    for scores, other in runs[1:]:
        differ = np.flatnonzero((scores.view(np.uint32) != first.view(np.uint32)).any(axis=1))
        assert differ.size == 0, f"the runs' logits differ from token {differ[0]} of {len(first)}"
        # the precisions served and the upgrades too (what is read on demand may differ: a
        # dropped prefetch is read when first used)
        assert other["served"] == stats["served"] and other["upgrades"] == stats["upgrades"], (other, stats)
