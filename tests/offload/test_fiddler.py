"""Fiddler's placement (Fiddler §3): a profile of calibration text says which experts are
selected most; those are loaded at start and kept (the popularity policy evicts the least
popular), the rest computed in place on the mapped model file. Exact to stock on every test
architecture, and the policy replayed by the simulator keeps a popular expert that LRU loses."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from hobbitpy.cli import main as cli_main
from hobbitpy.settings.config import OffloadConfig
from hobbitpy.plan.placement import expert_popularity
from hobbitpy.settings.presets import preset_settings
from hobbitpy.analysis.simulate import simulate
from hobbitpy.measure.trace import record_trace

from conftest import ARCHES, MB, PROMPT, hand_trace, run_logits, tiny_model

PROFILE_PROMPTS = ["The river ran quickly past the mill", "In the beginning of the year the farmers"]


@pytest.mark.parametrize("mode", ["gpu-centric", "cooperative"])
@pytest.mark.parametrize("arch", ARCHES)
def test_the_fiddler_preset_is_exact_to_stock(model_dir, arch, mode):
    path = tiny_model(model_dir, arch, n_layer=4)
    info = hobbitpy.inspect_model(path)
    ref, ref_text, _, _ = run_logits(path, OffloadConfig(enabled=False))
    # the profile: another text than the one run, as a user would make it (`hobbitpy trace`)
    popularity = expert_popularity(record_trace(path, PROFILE_PROMPTS, n_predict=8, n_ctx=128, lookahead=0))
    assert popularity.sum() > 0
    # a third of the experts fit: the popular third is held, the rest loaded (the preset) or
    # computed in place on the mapped file (Fiddler's CPU path)
    config = OffloadConfig(**{**preset_settings("fiddler"), "cache_mb": info.expert_bytes_total / 3 / MB,
                              "popularity": popularity.tolist(), "mode": mode})
    got, text, stats, _ = run_logits(path, config)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    assert text == ref_text
    assert stats["warm_loads"] > 0 and stats["expert_hits"] > 0
    if mode == "cooperative":  # never loaded on demand
        assert stats["expert_inplace"] > 0 and stats["expert_misses"] == 0
    else:
        assert stats["expert_misses"] > 0
    assert stats["peak_pool_bytes"] <= stats["budget_bytes"]


def test_the_simulated_popularity_policy_keeps_the_popular_expert_lru_loses():
    # one layer, top-1 of 8: expert 0 every third token, two of the others in turn between;
    # with 2 slots LRU evicts expert 0 while the scan passes, the profile keeps it
    steps = [0 if t % 3 == 0 else 1 + (t - 1 - t // 3) % 7 for t in range(201)]
    trace = hand_trace(np.array(steps, np.int32).reshape(-1, 1, 1), weight=1.0)
    lru = simulate(trace, 2, "lru")
    popular = simulate(trace, 2, "popularity")
    belady = simulate(trace, 2, "belady")
    assert popular.misses < lru.misses and popular.misses >= belady.misses
    assert lru.hits == 0 and popular.hits == 66  # expert 0's uses after the first
    # a profile saying expert 0 is the least popular keeps it no better than the scan
    contrary = np.ones((1, 8), np.float32)
    contrary[0, 0] = 0.0
    assert simulate(trace, 2, "popularity", popularity=contrary).misses > popular.misses
    with pytest.raises(hobbitpy.HobbitError, match="profile is for 2 MoE layers"):
        simulate(trace, 2, "popularity", popularity=np.ones((2, 8)))


def test_a_missing_or_foreign_profile_is_one_clear_error(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4)
    with pytest.raises(ValueError, match="--popularity TRACE"):
        OffloadConfig(**preset_settings("fiddler"))
    with pytest.raises(ValueError, match="--policy popularity"):
        OffloadConfig(popularity=((1.0, 2.0),))
    assert cli_main(["run", str(path), "--preset", "fiddler", "--prompt", PROMPT, "-n", "2"]) == 2
    assert "--popularity TRACE" in capsys.readouterr().err
    # a trace of a model with other layers and experts
    other = tiny_model(model_dir, "llama", n_layer=2, n_expert=4)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPT + "\n")
    trace = tmp_path / "other.npz"
    assert cli_main(["trace", str(other), "--prompts", str(prompts), "--out", str(trace), "-n", "2", "--ctx", "64"]) == 0
    capsys.readouterr()
    assert cli_main(["run", str(path), "--preset", "fiddler", "--popularity", str(trace), "--prompt", PROMPT,
                     "-n", "2"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "popularity given is for 2 MoE layers" in errors[0] and str(path) in errors[0]
