"""Static placement by importance: each expert held at one precision, the bits where the
routers put their weight. Pools hold exactly what is placed, warm-up loads each expert at
its level, every selection is served there; all at the model's own level it is stock bit
for bit, and between the levels it beats the uniform low copy on the trained model."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import hobbitpy
from hobbitpy.settings.config import OffloadConfig
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.files.model_file import layer_expert_bytes
from hobbitpy.plan.placement import expert_importance, place_by_importance, placement_bytes
from hobbitpy.copies.prepare import prepare_companion
from hobbitpy.measure.trace import read_prompts, record_trace

from conftest import MB, run_logits

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "ref-mixtral-Q8_0.gguf"
PROMPTS = REPO / "models" / "trace-prompts.txt"


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """ref-mixtral with Q4_K and Q2_K companions, and its importance on the shipped prompts."""
    folder = tmp_path_factory.mktemp("placement")
    model = folder / MODEL.name
    shutil.copy(MODEL, model)
    for t in ("Q4_K", "Q2_K"):
        prepare_companion(model, t, progress=False)
    trace = record_trace(model, read_prompts(PROMPTS)[:16], n_predict=16, n_ctx=256, n_threads=2)
    trace.save(folder / "trace.npz")
    return model, expert_importance(trace)


def test_greedy_places_the_most_weighed_experts_high_within_the_budget():
    importance = np.array([[5.0, 1.0, 3.0], [0.5, 4.0, 2.0]])
    level_bytes = [np.array([10, 10]), np.array([4, 4])]  # high, low: one expert of each layer
    all_low = 6 * 4
    for extra_experts in range(7):
        budget = all_low + extra_experts * 6
        p = place_by_importance(importance, level_bytes, budget)
        high = {(il, e) for il, row in enumerate(p) for e, level in enumerate(row) if level == 0}
        assert len(high) == extra_experts and placement_bytes(p, level_bytes) <= budget
        # the high ones are the most weighed
        ranked = sorted(((il, e) for il in range(2) for e in range(3)), key=lambda x: -importance[x])
        assert high == set(ranked[:extra_experts])
    # below every expert at the lowest level: all low (the cache then holds what fits)
    assert place_by_importance(importance, level_bytes, 10) == ((1, 1, 1), (1, 1, 1))


def test_pools_hold_exactly_the_placement_and_serve_it(placed):
    model, importance = placed
    levels = [layer_expert_bytes(model.with_name(f"{model.stem}.experts-{t}.gguf")) for t in ("Q4_K", "Q2_K")]
    budget = int(sum(levels[1]) * 8 + 10 * (levels[0][0] - levels[1][0]))  # room for ten experts at Q4_K
    llm = hobbitpy.Llama(model, high="Q4_K", low="Q2_K", hits="found", importance=importance.tolist(),
                         cache_mb=budget / MB, n_ctx=256, verbose=False, n_threads=2)
    try:
        placement = np.array(llm.placement)
        assert (placement == 0).sum() == 10
        slots = {p["level"]: p["n_slot"] for p in llm.pool_stats()}
        assert slots == {0: 10, 1: 38}  # exactly the placed experts: no copy twice, none evicted
        llm.create_completion("In the beginning", max_tokens=24, temperature=0.0)
        s = llm.offload_stats()
        assert s["n_skipped"] == 0 and s["upgrades"] == 0
        assert s["expert_misses"] + s["warm_loads"] <= 48  # every expert read once, at its level
    finally:
        llm.close()


def test_every_expert_placed_at_the_models_own_level_is_stock_bit_for_bit(placed):
    model, importance = placed
    stock, _, _, _ = run_logits(model, OffloadConfig(enabled=False))
    # a budget of every expert at the model's own precision: the placement is all level 0
    info = hobbitpy.inspect_model(model)
    config = OffloadConfig(low="Q2_K", importance=tuple(map(tuple, importance.tolist())),
                           cache_mb=info.expert_bytes_total / MB)
    logits, _, stats, _ = run_logits(model, config)
    assert stats["served"][1] == 0 and stats["served"][0] > 0
    assert np.array_equal(stock, logits)


def test_placed_beats_the_uniform_low_copy_at_a_little_more_memory(placed):
    model, importance = placed
    ids = tokenize_text(model, PROMPTS.read_text(), 384)
    ref = measure_reference(model, ids, n_ctx=256, n_threads=2)
    low_total = hobbitpy.inspect_model(model.with_name(f"{model.stem}.experts-Q2_K.gguf")).expert_bytes_total
    uniform = evaluate_against(model, ref, OffloadConfig(high="Q2_K", cache_mb=low_total / MB), n_ubatch=1, n_threads=2)
    mixed = evaluate_against(model, ref, OffloadConfig(high="Q4_K", low="Q2_K", hits="found",
                                                       importance=tuple(map(tuple, importance.tolist())),
                                                       cache_mb=1.25 * low_total / MB), n_ubatch=1, n_threads=2)
    # a quarter more memory than the all-Q2_K cache, spent on the most weighed experts, more
    # than halves the divergence (measured: KL 0.040 -> 0.014 on held-out text)
    assert mixed.mean_kl < 0.6 * uniform.mean_kl
    assert mixed.perplexity < uniform.perplexity


def test_a_wrong_importance_or_trace_is_one_clear_error(placed, tmp_path):
    model, importance = placed
    with pytest.raises(hobbitpy.HobbitError, match="importance given is for 6 MoE layers of 4 experts"):
        hobbitpy.Llama(model, low="Q2_K", importance=importance[:, :4].tolist(), cache_mb=8, verbose=False)
    with pytest.raises(ValueError, match="at least two precision levels"):
        OffloadConfig(importance=((1.0, 2.0),))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a trace")
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(model), "--low", "Q2_K", "--placed", str(bad),
                        "-p", "x", "-n", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "bad.npz: not a hobbitpy trace" in p.stderr and "Traceback" not in p.stderr


def test_placed_from_a_trace_on_the_command_line(placed):
    model, _ = placed
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(model), "--high", "Q4_K", "--low", "Q2_K",
                        "--hits", "found", "--placed", str(model.parent / "trace.npz"), "--cache-mb", "7",
                        "-p", "In the beginning", "-n", "8", "--temp", "0", "--stats-json", str(model.parent / "s.json")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    import json
    stats = json.loads((model.parent / "s.json").read_text())
    assert stats["n_skipped"] == 0 and sum(stats["served_share"]) == pytest.approx(1.0)
    # --skip-cached: a placement's resident experts are skipped by T2 too
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "run", str(model), "--high", "Q4_K", "--low", "Q2_K",
                        "--hits", "found", "--placed", str(model.parent / "trace.npz"), "--cache-mb", "7",
                        "--skip-cached", "--t1", "0", "--t2", "0",
                        "-p", "In the beginning", "-n", "8", "--temp", "0", "--stats-json", str(model.parent / "skip.json")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    stats = json.loads((model.parent / "skip.json").read_text())
    assert stats["n_skipped"] > 0


def test_a_placement_that_favours_some_layers_gets_a_slot_for_every_expert_it_places(tmp_path):
    """The hardened model's layers have two expert signatures (Q4_K_M's down projections are Q6_K
    in some layers, Q4_K in the rest), one pool each. A placement that raises the first layers'
    experts (as the default's order does where their inputs are large) gets a slot at each level
    for every expert placed there, in its own signature's pool, and reads each once: pools shared
    in proportion to each signature's bytes left some of them without one, read at every use (at
    real size 47 MB a token with every expert meant to be in memory)."""
    model = tmp_path / "h.gguf"
    shutil.copy(REPO / "models" / "ref-mixtral-8x7b-hardened-Q4_K_M.gguf", model)
    prepare_companion(model, "Q2_K", progress=False)
    info = hobbitpy.inspect_model(model)
    low = layer_expert_bytes(model.with_name(f"{model.stem}.experts-Q2_K.gguf"))
    assert len(set(layer_expert_bytes(model).tolist())) == 2  # two signatures at the model's precision
    first_layers_first = np.repeat(np.arange(info.n_layer_moe, 0, -1, dtype=np.float64)[:, None], info.n_expert, 1)
    low_total = int(low.sum()) * info.n_expert
    budget = low_total + (info.expert_bytes_total - low_total) // 3
    llm = hobbitpy.Llama(model, low="Q2_K", hits="found", importance=first_layers_first.tolist(), cache_mb=budget / MB,
                         n_ctx=256, verbose=False, n_threads=2)
    try:
        placement = np.array(llm.placement)
        slots = {0: 0, 1: 0}
        for pool in llm.pool_stats():
            slots[pool["level"]] += pool["n_slot"]
        assert slots == {0: int((placement == 0).sum()), 1: int((placement == 1).sum())}, slots
        llm.create_completion("In the beginning", max_tokens=16, temperature=0.0)
        s = llm.offload_stats()
        assert s["expert_misses"] + s["warm_loads"] <= placement.size, s  # every expert read once, at its level
    finally:
        llm.close()
