"""hobbitpy calibrate: thresholds within the perplexity budget, eq. 3 weights at least as
good as every named policy on the calibration trace, a profile that run applies."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

import hobbitpy
from hobbitpy.measure.calibrate import selection_scores, threshold_for_share
from hobbitpy.cli import main
from hobbitpy.copies.prepare import prepare_companion
from hobbitpy.plan.profile import load_profile, profile_path

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "ref-mixtral-Q8_0.gguf"
TEXT = REPO / "models" / "trace-prompts.txt"


def test_scores_follow_eq_2():
    w = np.array([[0.1, 0.5, -0.3, 0.1], [0.0, 0.0, 0.0, 0.0]], np.float32)
    s = selection_scores(w)
    assert np.allclose(s[0], [0.8, 0.0, 0.5, 0.9])
    assert np.array_equal(s[1], np.zeros(4))
    scores = np.arange(100) / 100.0
    assert (scores > threshold_for_share(scores, 0.2)).mean() == pytest.approx(0.2, abs=0.011)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calibrate")
    model = folder / MODEL.name
    shutil.copy(MODEL, model)
    prepare_companion(model, "Q2_K", progress=False)
    # 12 of the prompts file's 40 lines: a trace of 12 prompts (24 by default) and 64 tokens
    # scored per setting keep the sweep's rows and the weights' search, in a third of the time
    # (skipping 40 % of the selections still costs +7 % there, the Q2_K copy for them -0.8 %)
    lines = [line for line in TEXT.read_text().splitlines() if len(line.split()) >= 8]
    text = folder / "calibration.txt"
    text.write_text("\n".join(lines[:12]) + "\n")
    code = main(["calibrate", str(model), "--text", str(text), "--max-tokens", "64", "--threads", "2"])
    assert code == 0
    return model


def test_profile_meets_the_budget(calibrated):
    profile = load_profile(profile_path(calibrated), calibrated)
    s, c = profile.settings, profile.calibration
    assert s["low"] == "Q2_K" and s["policy"] == "hobbit"
    assert 0.0 <= s["t1"] <= s["t2"] <= 1.0
    assert abs(sum(s["policy_weights"]) - 1.0) < 1e-6
    assert c["perplexity"] <= c["reference_perplexity"] * 1.01
    # the sweep has HOBBIT Fig. 3b's rows: low-precision replacement and skipping at 10-40 %
    kinds = {(row["kind"], row["target_share"]) for row in c["sweep"]}
    assert {("low", q) for q in (0.1, 0.2, 0.3, 0.4)} <= kinds
    assert {("skip", q) for q in (0.1, 0.2, 0.3, 0.4)} <= kinds
    # skipping costs more than a low-precision copy of the same selections
    by = {(row["kind"], row["target_share"]): row["perplexity"] for row in c["sweep"]}
    assert by[("skip", 0.4)] > by[("low", 0.4)]


def test_calibrated_weights_beat_every_named_policy(calibrated):
    c = load_profile(profile_path(calibrated), calibrated).calibration
    ratio = {row["policy"]: np.mean(row["ratio_to_belady"]) for row in c["policies"]}
    # the grid holds every corner, so on its own trace it can only match or beat them
    for name in ("lru", "lfu", "lhu", "fld", "random"):
        assert ratio["hobbit (calibrated)"] <= ratio[name] + 1e-9, (name, ratio)
    assert all(r >= 1.0 - 1e-9 for r in ratio.values())


def test_run_applies_the_profile(calibrated, tmp_path, capsys):
    stats_file = tmp_path / "stats.json"
    code = main(["run", str(calibrated), "--prompt", "And the LORD said", "-n", "8", "--temp", "0",
                 "--cache-mb", "4", "--stats-json", str(stats_file)])
    assert code == 0
    assert "settings from" in capsys.readouterr().err
    stats = json.loads(stats_file.read_text())
    assert stats["runtime"]["n_level"] == 2
    # per pool and per precision, as --stats-json promises
    assert [p["level"] for p in stats["pools"]] == [0, 1]
    assert all({"hits", "misses", "bytes_read"} <= set(p) for p in stats["pools"])
    assert len(stats["served_share"]) == 2
    assert abs(sum(stats["served_share"]) + stats["skipped_share"] - 1.0) < 1e-9
    assert {"n_skipped", "prefetch_used", "prefetch_wasted"} <= set(stats)
    # --no-profile: one precision again
    code = main(["run", str(calibrated), "--prompt", "And the LORD said", "-n", "8", "--temp", "0",
                 "--cache-mb", "4", "--no-profile", "--stats-json", str(tmp_path / "plain.json")])
    assert code == 0
    assert json.loads((tmp_path / "plain.json").read_text())["runtime"]["n_level"] == 1


def test_profile_is_never_overwritten_and_belongs_to_its_model(calibrated, tmp_path, capsys):
    before = profile_path(calibrated).read_text()
    assert main(["calibrate", str(calibrated), "--text", str(TEXT)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert profile_path(calibrated).read_text() == before

    other = tmp_path / "other.gguf"
    shutil.copy(REPO / "models" / "ref-deepseek-Q8_0.gguf", other)
    with pytest.raises(hobbitpy.HobbitError, match="calibrate this model again"):
        load_profile(profile_path(calibrated), other)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["run", str(calibrated), "--prompt", "x", "-n", "1", "--profile", str(broken)]) == 2
    assert "broken.json" in capsys.readouterr().err
