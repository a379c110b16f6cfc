"""Fate's shallow-favoring allocation: a pool per MoE layer, the shallow layers whole, the
rest split evenly, ARC evicting within a layer; exact to stock on every test architecture,
and the boundary read from a trace."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from hobbitpy.plan.shallow_layers import layer_prediction_accuracy, shallow_boundary
from hobbitpy.settings.config import PREFILL_ORDERS, OffloadConfig
from hobbitpy.errors import BudgetError
from hobbitpy.settings.presets import FATE_LOW_SHARE, preset_settings

from conftest import (ARCHES, CONTINUATION, MB, PROMPT, fast_first, hand_trace, identical_companion, run_logits,
                      tiny_model)

# the fate preset at one precision (its prompts' low-precision share left out): exact
FATE_EXACT = {k: v for k, v in preset_settings("fate").items() if k not in FATE_LOW_SHARE}


@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_the_fate_preset_is_exact_to_stock(model_dir, arch):
    path = tiny_model(model_dir, arch, n_layer=4)
    info = hobbitpy.inspect_model(path)
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    # room for the first layer's experts and a little more than each other layer's top-k
    per_expert = info.expert_bytes_total / info.n_expert / info.n_layer_moe
    budget = per_expert * (info.n_expert + (info.n_layer_moe - 1) * (info.n_expert_used + 1))
    # the fate preset: a pool per layer with the first whole, ARC per layer, widened prefetch
    config = OffloadConfig(**{**FATE_EXACT, "cache_mb": budget / MB, "mode": "gpu-centric"})
    got, text, stats, _ = run_logits(path, config)
    assert stats["expert_misses"] > 0
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert text == ref_text
    assert stats["peak_pool_bytes"] <= stats["budget_bytes"]


@pytest.mark.parametrize("order", PREFILL_ORDERS)
@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_a_prompt_wider_than_the_pools_loads_the_next_layer_in_either_order_exactly(model_dir, arch, order):
    # Q4_K experts are repacked for the CPU's kernels and never run in place: a prompt wider
    # than a layer's pool goes through it in waves, and while a layer computes the next one's
    # experts are loaded, most popular first (the next router on this layer's input) or in
    # expert order; either way the logits are stock's
    path = tiny_model(model_dir, arch, n_layer=4, expert_type="Q4_K", n_embd=256, n_ff=512)
    info = hobbitpy.inspect_model(path)
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    per_expert = info.expert_bytes_total / info.n_expert / info.n_layer_moe
    budget = per_expert * (info.n_expert + (info.n_layer_moe - 1) * (info.n_expert_used + 1))
    config = OffloadConfig(**{**FATE_EXACT, "cache_mb": budget / MB, "prefill_order": order})
    got, text, stats, _ = run_logits(path, config)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert text == ref_text
    assert stats["expert_inplace"] == 0 and stats["prefetch_issued"] > 0


def test_a_budget_below_a_pool_per_layer_runs_one_shared_pool_exactly(model_dir):
    # the fate preset under a tight cap: every layer's top-k does not fit, one token's does;
    # the run falls back to one pool shared by every layer (and says so) instead of refusing
    path = tiny_model(model_dir, "llama", n_layer=4)
    info = hobbitpy.inspect_model(path)
    shared_min = info.min_budget_bytes
    per_layer_min = info.expert_bytes_total // info.n_expert * info.n_expert_used
    assert 2 * shared_min < per_layer_min
    config = OffloadConfig(**{**FATE_EXACT, "cache_mb": 2 * shared_min / MB})
    llm = hobbitpy.Llama(path, offload=config, n_ctx=64, verbose=False)
    try:
        assert llm.offload_plan.shared_pool and "one pool shared by every layer" in llm.offload_plan.reason
        assert llm.offload_config.shallow_layers is None and llm.offload_config.policy == "arc"
    finally:
        llm.close()
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    got, text, stats, _ = run_logits(path, config)
    assert stats["expert_misses"] > 0 and stats["peak_pool_bytes"] <= stats["budget_bytes"]
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)) and text == ref_text
    with pytest.raises(BudgetError, match="below the minimum"):
        hobbitpy.Llama(path, cache_mb=0.5 * shared_min / MB, shallow_layers=0, n_ctx=64, verbose=False)


def _fate_with_low_copies(path, low, share: float, **kw) -> OffloadConfig:
    """The fate preset with its INT2 share (§4.5) from `low`: a pool per layer at the high level,
    one shared low pool; decode wants the high level only (t1 = t2 = 1) and gets exactly it
    (hits exact)."""
    info = hobbitpy.inspect_model(path)
    per_expert = info.expert_bytes_total / info.n_expert / info.n_layer_moe
    budget = per_expert * (info.n_expert + (info.n_layer_moe - 1) * (info.n_expert_used + 1) + 2 * info.n_expert)
    return OffloadConfig(**{**preset_settings("fate"), "cache_mb": budget / MB, "mode": "gpu-centric", "low": str(low),
                            "level_shares": (0.75, 0.25), "prefill_low_share": share, **kw})


@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_a_prompt_serves_its_least_popular_experts_from_the_low_level_and_decode_never(model_dir, arch):

    # the low level holds byte copies of the experts: which level serves what is seen in the
    # counters while the logits stay stock's (the plumbing checked exactly)
    path = tiny_model(model_dir, arch, n_layer=4)
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    got, text, stats, _ = run_logits(path, _fate_with_low_copies(path, low, 0.3))
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)) and text == ref_text
    assert stats["served"][1] > 0 and stats["n_skipped"] == 0, stats["served"]
    assert stats["peak_pool_bytes"] <= stats["budget_bytes"]

    with hobbitpy.Llama(path, offload=_fate_with_low_copies(path, low, 0.3), n_ctx=128, verbose=False) as llm:
        assert [p["level"] for p in llm.pool_stats()].count(1) == 1  # one low pool; a pool per layer high
        llm.eval(llm.tokenize(PROMPT.encode()))
        assert llm.offload_stats()["served"][1] > 0
        llm.reset_offload_stats()
        for t in llm.tokenize(CONTINUATION.encode(), add_bos=False)[:6]:
            llm.eval([t])
        assert llm.offload_stats()["served"][1] == 0  # decode: the high level only, as Fate transfers

    # no share: nothing is served low at all
    _, _, stats, _ = run_logits(path, _fate_with_low_copies(path, low, 0.0))
    assert stats["served"][1] == 0

    # a low pool of one token's top-k: the least popular the low pool cannot take get high
    # slots (hits "exact" or not, the share never stalls a prompt)
    got, text, stats, _ = run_logits(path, _fate_with_low_copies(path, low, 0.5, level_shares=(1.0, 0.0)))
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)) and text == ref_text
    assert stats["served"][1] > 0


@pytest.mark.parametrize("share", [0.0, 0.3])
def test_a_prompt_wider_than_the_high_pools_runs_in_waves_with_exact_hits(model_dir, share):

    # repacked Q4_K experts never run in place: a prompt wider than a layer's slots runs in
    # waves, counted on every level's slots; with hits "exact" and every selection wanting the
    # high level, a wave whose high slots are all taken must still not leave the last wave more
    # experts than it has slots (it failed so: "layer 1 selects 24 experts in one ubatch but
    # its pools hold 12")
    path = tiny_model(model_dir, "llama", n_layer=4, expert_type="Q4_K", n_embd=256, n_ff=512, n_expert=16,
                      n_expert_used=4)
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    info = hobbitpy.inspect_model(path)
    per_expert = info.expert_bytes_total / info.n_expert / info.n_layer_moe
    budget = per_expert * (info.n_layer_moe * info.n_expert_used + 6)
    config = OffloadConfig(**{**preset_settings("fate"), "shallow_layers": 0, "cache_mb": budget / MB, "low": str(low),
                              "level_shares": (0.5, 0.5), "prefill_low_share": share})
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    got, text, stats, _ = run_logits(path, config)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)) and text == ref_text
    assert stats["expert_inplace"] == 0


def test_the_low_share_is_lossy_with_real_low_copies(model_dir):
    from hobbitpy.copies.prepare import prepare_companion

    path = tiny_model(model_dir, "llama", n_layer=4)
    low = model_dir / f"{path.stem}.share-Q2_K.gguf"
    if not low.exists():
        prepare_companion(path, "Q2_K", out_path=low, progress=False)
    ref, _, _, _ = run_logits(path, OffloadConfig(enabled=False))
    exact, _, _, _ = run_logits(path, _fate_with_low_copies(path, low, 0.0))
    assert np.array_equal(ref.view(np.uint32), exact.view(np.uint32))
    lossy, _, stats, _ = run_logits(path, _fate_with_low_copies(path, low, 0.5))
    assert stats["served"][1] > 0 and not np.array_equal(ref, lossy)


def test_a_low_share_needs_a_low_level_and_a_share():
    with pytest.raises(ValueError, match="needs a low precision"):
        OffloadConfig(prefill_low_share=0.2)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="prefill_low_share"):
            OffloadConfig(low="Q2_K", prefill_low_share=bad)
    with pytest.raises(ValueError, match="shallow_layers"):
        OffloadConfig(shallow_layers=-1)
    with pytest.raises(ValueError, match="placed by importance"):
        OffloadConfig(shallow_layers=1, low="Q2_K", importance=((1.0, 1.0),))


def test_the_boundary_is_where_the_prediction_becomes_good():
    # 4 layers, top-2 of 4 experts, 2 tokens; predicted[t, l, 0] is the guess for layer l + 1
    experts = np.array([[[0, 1], [0, 1], [2, 3], [0, 2]],
                        [[1, 2], [2, 3], [0, 1], [1, 3]]], np.int32)
    predicted = np.full((2, 4, 1, 2), -1, np.int32)
    predicted[:, 0, 0] = [[0, 3], [3, 1]]  # layer 1: 2 of 4 named
    predicted[:, 1, 0] = [[2, 3], [0, 1]]  # layer 2: all
    predicted[:, 2, 0] = [[0, 2], [3, 0]]  # layer 3: 3 of 4
    accuracy = layer_prediction_accuracy(hand_trace(experts, n_expert=4, predicted=predicted, weight=1.0))
    assert accuracy.tolist() == [0.0, 0.5, 1.0, 0.75]
    assert shallow_boundary(accuracy) == 4          # layer 3 is below 0.9 of the best
    assert shallow_boundary(accuracy, share=0.7) == 2
    assert shallow_boundary(np.array([0.0, 0.9, 0.9])) == 1  # the first layer is always shallow


def test_simulate_prints_the_boundary(model_dir, tmp_path):
    import subprocess
    import sys


    path = tiny_model(model_dir, "llama", n_layer=4)
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    out = tmp_path / "t.npz"
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "trace", str(path), "--prompts", str(prompts), "--out", str(out),
                        "-n", "8"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "simulate", str(out), "--budget-mb", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    line = [x for x in p.stdout.splitlines() if x.startswith("next-layer prediction accuracy")]
    assert len(line) == 1 and "--shallow-layers " in line[0], p.stdout
