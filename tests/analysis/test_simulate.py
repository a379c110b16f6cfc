"""Routing traces and the offline cache simulator: the simulator replays the runtime's
own policies, so on a trace recorded token by token it must count exactly the hits and
misses the runtime counted while recording it."""

from __future__ import annotations

import json

import numpy as np
import pytest

import hobbitpy
from hobbitpy import HobbitError, OffloadConfig
from hobbitpy.cli import main as cli_main
from hobbitpy.analysis.simulate import simulate, simulate_all, slots_per_layer
from hobbitpy.measure.trace import record_trace
from hobbitpy.files.trace_file import load_trace

from conftest import MB, hand_trace, run_logits, session_copy, tiny_model

PROMPTS = ["Once upon a time there was a lighthouse", "The river ran quickly past the mill",
           "In the beginning of the year the farmers"]


def _slots_budget_mb(info, n_slot: int) -> float:
    return n_slot * info.expert_bytes / MB


@pytest.mark.parametrize("policy", ["lru", "lfu", "lhu", "fld", "weighted", "arc"])
def test_simulator_counts_what_the_runtime_counted(model_dir, policy):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    budget = _slots_budget_mb(info, 10)  # 10 of 32 experts: evictions all along
    t = record_trace(path, PROMPTS, n_predict=10, cache_mb=budget, policy=policy, n_batch=1, n_ctx=128, lookahead=2)
    rt = t.meta["runtime"]
    assert rt["n_slot"] == 10
    r = simulate(t, budget, policy)
    assert r.accesses == t.n_tokens * 4 * 2  # distinct experts per token and layer (top-k has no repeats)
    assert (r.hits, r.misses) == (rt["expert_hits"], rt["expert_misses"])
    assert r.hits > 0 and r.misses > 0


def test_belady_bounds_every_policy(model_dir):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    t = record_trace(path, PROMPTS, n_predict=16, n_ctx=128, lookahead=1)
    for n_slot in (4, 8, 16):
        results = {r.policy: r for r in simulate_all(t, [_slots_budget_mb(info, n_slot)])}
        assert set(results) == {"lru", "lfu", "lhu", "fld", "arc", "popularity", "score", "frequency", "random",
                                "belady"}
        best = results["belady"].misses
        for r in results.values():
            assert r.misses >= best
            assert r.bytes_read == r.misses * info.expert_bytes
            assert r.miss_penalty == r.misses  # one precision: every miss costs 1
        assert results["lru"].misses > best
    # every expert fits: only the cold misses remain, the same for all
    everything = {r.misses for r in simulate_all(t, [_slots_budget_mb(info, 32)])}
    assert everything == {len(np.unique(t.experts.reshape(t.n_tokens, -1) + 8 * np.arange(4).repeat(2)))}


def test_simulated_substitution_serves_misses_from_the_cache(model_dir):
    # importance-driven scheduling's substitution replayed on a trace as routed: the runtime's
    # own plan (hobbit-substitution) against the simulated cache, step by step
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    t = record_trace(path, PROMPTS, n_predict=16, n_ctx=128, lookahead=1)
    budget = _slots_budget_mb(info, 8)
    plain = simulate(t, budget, "lru")
    substituted = simulate(t, budget, "lru", substitute_alpha=0.3)
    assert plain.substituted == 0 and substituted.substituted > 0
    assert substituted.accesses == plain.accesses and substituted.misses < plain.misses
    # Belady's bound stays the trace as routed
    assert simulate(t, budget, "belady", substitute_alpha=0.3).substituted == 0


def test_a_trace_records_the_selection_of_sigmoid_grouped_biased_routing(model_dir):
    """DeepSeek-V3's routing (deepseek2: sigmoid scores, a selection bias, 2 of 4 expert
    groups, weights normalized and scaled by 2.5): the trace holds the graph's own choices
    (each token's experts within two groups, the weights its unbiased scores normalized and
    scaled), and the simulator replaying it counts what the runtime counted."""
    path = tiny_model(model_dir, "deepseek2")
    info = hobbitpy.inspect_model(path)
    budget = _slots_budget_mb(info, 8)
    t = record_trace(path, PROMPTS, n_predict=6, cache_mb=budget, policy="lru", n_batch=1, n_ctx=128)
    groups = t.experts // (info.n_expert // 4)
    assert max(len(set(row)) for row in groups.reshape(-1, info.n_expert_used).tolist()) <= 2
    probs = t.probs.astype(np.float32)  # sigmoid scores: not a distribution
    assert not np.allclose(probs.sum(-1), 1.0, atol=0.1)
    chosen = np.take_along_axis(probs, t.experts, axis=-1)
    np.testing.assert_allclose(t.weights, 2.5 * chosen / chosen.sum(-1, keepdims=True), rtol=5e-3)
    r = simulate(t, budget, "lru")
    rt = t.meta["runtime"]
    assert (r.hits, r.misses) == (rt["expert_hits"], rt["expert_misses"]) and r.misses > 0


def test_trace_contents(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    t = record_trace(path, PROMPTS, n_predict=6, n_ctx=128, lookahead=3)
    n = t.n_tokens
    assert t.experts.shape == (n, 4, 2) and t.weights.shape == (n, 4, 2)
    assert t.probs.shape == (n, 4, 8) and t.predicted.shape == (n, 4, 3, 2)
    assert int(t.seq_start.sum()) == len(PROMPTS) and t.seq_start[0] == 1
    assert ((t.experts >= 0) & (t.experts < 8)).all()
    assert (t.experts[..., 0] != t.experts[..., 1]).all()
    # llama arch (Mixtral): softmax router, gate weights = the top-k probabilities renormalized
    probs = t.probs.astype(np.float32)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=2e-3)
    top = np.take_along_axis(probs, t.experts, axis=-1)
    np.testing.assert_allclose(t.weights, top / top.sum(-1, keepdims=True), atol=5e-3)
    assert (np.argmax(probs, -1) == t.experts[..., 0]).all()
    # predictions run past the last layer: -1 there
    assert (t.predicted[:, 3] == -1).all() and (t.predicted[:, 2, 1:] == -1).all()
    assert ((t.predicted[:, 0] >= 0) & (t.predicted[:, 0] < 8)).all()

    out = t.save(tmp_path / "trace.npz")
    back = load_trace(out)
    np.testing.assert_array_equal(back.experts, t.experts)
    np.testing.assert_array_equal(back.predicted, t.predicted)
    assert back.meta == json.loads(json.dumps(t.meta))
    with pytest.raises(FileExistsError):
        t.save(out)


def test_bad_trace_files(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip at all")
    with pytest.raises(HobbitError, match="bad.npz"):
        load_trace(bad)
    with pytest.raises(HobbitError, match="no such trace"):
        load_trace(tmp_path / "missing.npz")
    assert cli_main(["simulate", str(bad), "--budget-mb", "10"]) == 2
    assert "bad.npz" in capsys.readouterr().err


def test_trace_and_simulate_commands(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    out = tmp_path / "t.npz"
    assert cli_main(["trace", str(path), "--prompts", str(prompts), "--out", str(out), "-n", "4", "--ctx", "128"]) == 0
    assert cli_main(["trace", str(path), "--prompts", str(prompts), "--out", str(out)]) == 2  # never overwrites
    capsys.readouterr()
    budget = f"{_slots_budget_mb(info, 6):.4f}"
    assert cli_main(["simulate", str(out), "--budget-mb", budget, "--json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    for name in ("lru", "lfu", "fld", "random", "belady", "misses/Belady"):
        assert name in text
    rows = json.loads((tmp_path / "s.json").read_text())
    assert {r["policy"] for r in rows} >= {"lru", "belady"}
    # an existing results file is overwritten only with --force
    assert cli_main(["simulate", str(out), "--budget-mb", budget, "--json", str(tmp_path / "s.json")]) == 2
    assert "only with --force" in capsys.readouterr().err
    assert json.loads((tmp_path / "s.json").read_text()) == rows
    # a budget below one token's top-k is refused with the numbers
    assert cli_main(["simulate", str(out), "--budget-mb", f"{_slots_budget_mb(info, 1):.4f}"]) == 2
    assert "one token needs 2" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["lfu", "lhu", "fld", "random", "weighted", "arc", "score"])
def test_every_policy_is_exact(model_dir, policy):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    got, text, stats, _ = run_logits(path, OffloadConfig(cache_mb=_slots_budget_mb(info, 3), policy=policy, mode="gpu-centric"))
    assert stats["expert_misses"] > 0
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert text == ref_text


def test_simulated_prefetch_of_perfect_guesses_leaves_the_first_layers_misses():
    # every layer's guess is the next layer's real selection: with room for a layer and the
    # next one's guess, nothing past the first MoE layer ever misses; wrong guesses cost reads
    rng = np.random.default_rng(0)
    n, n_layer, k = 60, 4, 2
    experts = np.array([[rng.choice(8, k, replace=False) for _ in range(n_layer)] for _ in range(n)], np.int32)
    perfect = np.full((n, n_layer, 1, k), -1, np.int32)
    perfect[:, :-1, 0] = experts[:, 1:]
    t = hand_trace(experts, predicted=perfect)
    budget = 2 * k  # MB: slots of 1 MB
    plain = simulate(t, budget, "lru")
    ahead = simulate(t, budget, "lru", prefetch_layers=1)
    assert ahead.accesses == plain.accesses == n * n_layer * k
    assert ahead.misses <= n * k < plain.misses  # only the first layer's
    assert ahead.prefetch_used == ahead.prefetched > 0
    assert ahead.bytes_read == (ahead.misses + ahead.prefetched) * MB
    assert simulate(t, budget, "belady", prefetch_layers=1).prefetched == 0  # the bound stays demand-only

    wrong = perfect.copy()
    wrong[:, :-1, 0] = (experts[:, 1:] + 3) % 8
    guessed_wrong = simulate(hand_trace(experts, predicted=wrong), budget, "lru", prefetch_layers=1)
    assert guessed_wrong.prefetched > 0 and guessed_wrong.prefetch_used < guessed_wrong.prefetched
    with pytest.raises(HobbitError, match="guesses 1 layers ahead"):
        simulate(t, budget, "lru", prefetch_layers=2)


def test_every_preset_is_replayed_with_its_rules(model_dir, tmp_path, capsys):
    from hobbitpy.settings.presets import PRESETS, preset_settings
    from hobbitpy.analysis.simulate import simulate_preset

    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    t = record_trace(path, PROMPTS, n_predict=16, n_ctx=128, lookahead=2)
    budget = _slots_budget_mb(info, 6)
    plain = simulate(t, budget, "lru")
    for name in PRESETS:
        settings = preset_settings(name)
        r = simulate_preset(t, budget, name, low_miss_cost=0.31)
        assert r.policy == f"{name} preset" and r.accesses == plain.accesses
        assert (r.prefetched > 0) == (settings.get("prefetch_layers", 0) > 0)
        assert (r.substituted > 0) == (settings.get("substitute_alpha", 0) > 0)
        # a low precision that decode uses makes some misses cheaper than a high one (fate's
        # serves prompts only: its T1 of 1 wants every decode selection high)
        assert (r.miss_penalty < r.misses) == ("low" in settings and settings.get("t1", 0.0) < 1.0)
    out = tmp_path / "t.npz"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert cli_main(["trace", str(path), "--prompts", str(prompts), "--out", str(out), "-n", "4", "--ctx", "128",
                     "--lookahead", "1"]) == 0
    capsys.readouterr()
    assert cli_main(["simulate", str(out), "--budget-mb", f"{budget:.4f}", "--policy", "lru", "belady",
                     "--preset", "importance", "hobbit", "--prefetch-layers", "1"]) == 0
    text = capsys.readouterr().out
    assert "importance preset" in text and "hobbit preset" in text and "prefetched" in text
    # the hobbit preset prefetches two layers; a trace of one layer's guesses replays one
    assert cli_main(["simulate", str(out), "--budget-mb", f"{budget:.4f}", "--prefetch-layers", "2"]) == 2
    assert "guesses 1 layers ahead" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc"])
def test_a_pool_per_layer_is_replayed_as_the_runtime_ran_it(model_dir, policy):
    # the runtime's --shallow-layers 0: a pool per MoE layer, its own policy each, 10 slots
    # dealt 3/3/2/2; the replay deals them the same way and counts the same hits and misses
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    budget = _slots_budget_mb(info, 10)
    t = record_trace(path, PROMPTS, n_predict=10, cache_mb=budget, policy=policy, n_batch=1, n_ctx=128, lookahead=2,
                     shallow_layers=0)
    rt = t.meta["runtime"]
    per_layer = simulate(t, budget, policy, per_layer=True)
    assert per_layer.n_slot == rt["n_slot"] == 10
    assert (per_layer.hits, per_layer.misses) == (rt["expert_hits"], rt["expert_misses"])
    shared = simulate(t, budget, policy)
    assert per_layer.accesses == shared.accesses and per_layer.misses != shared.misses
    assert slots_per_layer(t, budget) == [3, 3, 2, 2]
    # Fate's shallow layer: the first whole (8 slots), 2 for each of the others
    wide = _slots_budget_mb(info, 14)
    assert slots_per_layer(t, wide, shallow_layers=1) == [8, 2, 2, 2]
    t1 = record_trace(path, PROMPTS, n_predict=10, cache_mb=wide, policy=policy, n_batch=1, n_ctx=128, lookahead=2,
                      shallow_layers=1)
    r1 = simulate(t1, wide, policy, per_layer=True, shallow_layers=1)
    assert (r1.hits, r1.misses) == (t1.meta["runtime"]["expert_hits"], t1.meta["runtime"]["expert_misses"])
    with pytest.raises(HobbitError, match="below the 2 a pool per layer needs in each of 4 MoE layers"):
        simulate(t, _slots_budget_mb(info, 7), policy, per_layer=True)
    with pytest.raises(HobbitError, match="shared pool only"):
        simulate(t, budget, policy, per_layer=True, prefetch_layers=1)


def test_the_replay_counts_what_the_runtime_counted_on_prompts_and_decode_over_two_levels_and_a_pool_per_layer(model_dir):
    # the runtime's own cache driven offline over a recorded routing (Llama.replay): prompts in
    # ubatches of 16 tokens (waves level by level with hits exact, the next layer loaded whole),
    # then decode token by token, over two levels (the model's experts and a Q2_K copy) with a
    # pool per MoE layer at the high one; every count is the runtime's
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    low = session_copy(path, "Q2_K")
    info, low_info = hobbitpy.inspect_model(path), hobbitpy.inspect_model(low)
    budget = (info.expert_bytes_total + low_info.expert_bytes_total) * 0.4 / MB
    with hobbitpy.Llama(path, low=str(low), hits="exact", shallow_layers=0, prefetch_layers=0, mode="gpu-centric",
                        warm=False, cache_mb=budget, n_ctx=256, n_batch=16, n_ubatch=16, logits_all=True, n_threads=2,
                        verbose=False) as llm:
        prompts = [llm.tokenize(f"{p} and the people of the town went on with their work".encode()) for p in PROMPTS]
        routing = llm.record_routing(prompts, n_predict=12)
        ran, replayed = llm.offload_stats(), llm.replay(routing)
    assert sum(routing.ubatch_start) > len(prompts) and len(routing.ubatch_start) == len(routing.tokens)
    assert ran["n_level"] == 2 and ran["served"][0] > 0 and ran["served"][1] > 0, ran["served"]
    for key in ("n_slot", "pool_bytes", "expert_hits", "expert_misses", "served", "n_skipped", "prefetch_issued",
                "bytes_read"):
        assert replayed[key] == ran[key], (key, replayed[key], ran[key])
    assert ran["expert_hits"] > 0 and ran["expert_misses"] > 0
    # what a replay cannot know is refused: the decode prefetch needs the router inputs
    with hobbitpy.Llama(path, cache_mb=budget, prefetch_layers=1, n_ctx=64, verbose=False) as llm:
        with pytest.raises(HobbitError, match="without prediction"):
            llm.replay(routing)
        # a routing llama.cpp cannot give whole (its last layer routes only the rows it outputs) or
        # prompts that are text, not token ids: said, not a count that disagrees or a TypeError
        with pytest.raises(HobbitError, match="needs a Llama made with logits_all=True"):
            llm.record_routing(prompts, n_predict=2)
    with hobbitpy.Llama(path, cache_mb=budget, n_ctx=64, logits_all=True, verbose=False) as llm:
        with pytest.raises(HobbitError, match="each prompt as a list of token ids"):
            llm.record_routing(["and the people of the town"])
