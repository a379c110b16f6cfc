"""What runs with no flags when a model's experts do not all fit (default_ladder.py): the
choice itself, and `hobbitpy run` under a real memory cap making what the ladder needs once,
reusing it, and staying exact with --exact, a preset or --no-prepare."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import hobbitpy
from hobbitpy.runtime.default_ladder import (CACHE_POLICY, DYNAMIC_MIN_MISSED, DYNAMIC_PREFETCH_LAYERS,
                                             DYNAMIC_THRESHOLDS, LOW_TYPE, MAX_MEAN_KL, NEXT_TYPE_GAIN, Calibration, Priced,
                                             calibration_text, copy_rounding_error, default_config, importance_path,
                                             kept_importance,
                                             ladder_placement, load_calibration, low_copy_bytes, low_copy_layer_bytes,
                                             low_weight_share, placed_bytes, remembered_failure, save_calibration,
                                             unfit_reason, with_kept_prior)
from hobbitpy.errors import ExpertReadError
from hobbitpy.runtime import default_ladder
from hobbitpy.runtime.llama import compare_ladder, measure_calibration
from hobbitpy.plan.memory import ContextShape
from hobbitpy.system.disk import drop_from_page_cache
from hobbitpy.files.inflate import inflate
from hobbitpy.files.model_file import layer_expert_bytes
from hobbitpy.system.memory_cgroup import MemoryCap
from hobbitpy.copies.companions import default_companion_path
from hobbitpy.copies.prepare import prepare_companion

from conftest import MB, model_without_byte_tokens

PROMPT = "Once upon a time, in a quiet village by the sea"
MODEL = pathlib.Path(__file__).resolve().parents[2] / "models" / "ref-mixtral-Q8_0.gguf"
HARDENED = MODEL.with_name("ref-mixtral-8x7b-hardened-Q4_K_M.gguf")


def _info(n_layer=4, n_expert=8, n_embd=256, n_ff=1024, bytes_per_weight=34 / 32) -> hobbitpy.ModelInfo:
    expert = int(3 * n_embd * n_ff * bytes_per_weight)
    return hobbitpy.ModelInfo(path="m.gguf", arch="llama", n_layer=n_layer, n_layer_moe=n_layer, n_expert=n_expert,
                              n_expert_used=2, n_embd=n_embd, expert_bytes=expert,
                              expert_bytes_total=n_layer * n_expert * expert, min_budget_bytes=2 * expert,
                              file_bytes=n_layer * n_expert * expert + 10 * MB, uniform=True, n_ff_expert=n_ff,
                              max_slice_bytes=expert // 3)


def test_what_rules_a_ladder_out_before_anything_is_measured():
    info = _info()
    assert unfit_reason(info, 10 ** 9) is None
    assert "no room" in unfit_reason(info, None) and "exact" in unfit_reason(info, None)
    # a model whose experts are no larger than the low copy
    assert "no smaller" in unfit_reason(_info(bytes_per_weight=84 / 256), 10 ** 12)
    # rows that are not whole blocks of the low type
    assert "not whole" in unfit_reason(_info(n_ff=1000), 10 ** 12)


def test_the_ladder_a_budget_gives_raises_the_most_weighed_experts():
    info = _info()
    model_bytes = np.full(info.n_layer_moe, info.expert_bytes, np.int64)
    low = low_copy_layer_bytes(info)
    low_total = int(low.sum()) * info.n_expert
    assert 0 < low_total < info.expert_bytes_total
    extra = info.expert_bytes - int(low[0])
    skewed = np.full((info.n_layer_moe, info.n_expert), 0.01)
    skewed[:, :2] = 1.0
    placement, n_high = ladder_placement(info, model_bytes, low_total + 2 * info.n_layer_moe * extra, skewed)
    assert n_high == 8 and all(row[:2] == (0, 0) and set(row[2:]) == {1} for row in placement)
    # a budget below the copy: every expert at the low level, read through the cache
    placement, n_high = ladder_placement(info, model_bytes, low_total - 1, skewed)
    assert n_high == 0 and {x for row in placement for x in row} == {1}


def test_a_measured_ladder_settles_the_ladders_it_bounds():
    c = Calibration(np.ones((2, 4)), 100)
    assert c.verdict(4) is None
    four = Priced(4, MAX_MEAN_KL / 2, 0.004)
    c = c.priced(four)
    # as many or more experts at the model's precision than a ladder within: within
    assert c.verdict(4) == four and c.verdict(8) == four and c.verdict(3) is None
    two = Priced(2, MAX_MEAN_KL * 3, -0.01)  # (the perplexity does not decide: the divergence does)
    c = c.priced(two)
    # as few or fewer than a ladder beyond: beyond
    assert c.verdict(2) == two and c.verdict(1) == two and c.verdict(3) is None and c.verdict(5) == four
    # ... and for a ladder whose n_beyond (the one a little less memory allows) has as few or fewer
    assert c.verdict(3, n_beyond=2) == two and c.verdict(3, n_beyond=3) is None and c.verdict(5, n_beyond=2) == four
    # ... and, priced a slack below a budget's own, every budget up to a slack above that one: a run
    # finding an expert more memory than the one that measured it measures nothing (runs under the
    # same memory differ by about that); measured for itself (every expert at the copy), no more
    priced_below = Priced(2, MAX_MEAN_KL * 3, -0.01, stands_for=3)
    slack_above = Calibration(np.ones((2, 4)), 100).priced(priced_below)
    assert slack_above.verdict(4, n_beyond=3) == priced_below and slack_above.verdict(5, n_beyond=4) is None
    assert Calibration(np.ones((2, 4)), 100).priced(two).verdict(4, n_beyond=3) is None
    assert c.ladders == (two, four) and not two.within and four.within
    # measured again: the new figure replaces the old
    assert c.priced(Priced(4, 0.0, 0.0)).ladders == (two, Priced(4, 0.0, 0.0))


def test_a_ladder_keeps_no_more_experts_at_the_model_precision_than_the_limit_needs():
    """Every expert at the low copy within the limit: placed for the copy's bytes alone, whatever
    the budget (the fewest bytes a token: more memory never decodes slower); measured beyond, or
    not measured: placed for the budget."""
    info = _info()
    low_total = low_copy_bytes(info)
    budget = low_total + (info.expert_bytes_total - low_total) // 2
    c = Calibration(np.ones((info.n_layer_moe, info.n_expert)), 100)
    assert placed_bytes(info, budget, c) == budget
    assert placed_bytes(info, budget, c.priced(Priced(0, MAX_MEAN_KL * 2, 0.01))) == budget
    within = c.priced(Priced(0, MAX_MEAN_KL / 2, 0.001))
    assert placed_bytes(info, budget, within) == low_total
    assert placed_bytes(info, low_total - 1, within) == low_total - 1  # the copy through the cache
    model_bytes = np.full(info.n_layer_moe, info.expert_bytes, np.int64)
    assert ladder_placement(info, model_bytes, placed_bytes(info, budget, within), within.importance)[1] == 0


def test_low_weight_share():
    importance = np.array([[3.0, 1.0], [0.0, 4.0]])
    assert low_weight_share(importance, ((0, 1), (1, 0))) == pytest.approx(1 / 8)
    assert low_weight_share(importance, ((0, 0), (0, 0))) == 0.0


def test_the_calibration_text_ships_with_the_package():
    text = calibration_text()
    assert len(text.split()) > 1000 and "def " in text and "The LORD is my shepherd" in text



def test_the_calibration_leaves_out_what_the_vocabulary_cannot_encode(tmp_path):
    """A vocabulary without "\\n" and without byte tokens: the calibration text (hobbitpy's, not
    the user's) is measured without the characters it cannot encode, instead of failing the run."""
    model = model_without_byte_tokens(tmp_path)
    text = calibration_text()
    with hobbitpy.Llama(str(model), offload=hobbitpy.OffloadConfig(cache_mb=1), n_ctx=64, verbose=False) as llm:
        with pytest.raises(hobbitpy.TokenizeError):
            llm.tokenize(text.encode())
        kept = llm.encodable(text)
        assert "\n" not in kept and "the" in kept and len(llm.tokenize(kept.encode())) > 100
        assert llm.encodable("the cat") == "the cat"
    calibration = measure_calibration(str(model), text, 2)
    assert calibration.n_tokens > 100 and calibration.importance.sum() > 0


# a memory whose two-level budget holds the Q2_K copy of ref-mixtral's experts and some at Q8_0,
# and one with room for more of them (budgets of 10 and 14 MB for experts of 20 MB)
LESS_MEMORY, SOME_MEMORY, MORE_MEMORY = 34 * MB, 40 * MB, 45 * MB


def _default_of(model: pathlib.Path, available: int, score, measure=None, **chosen):
    info = hobbitpy.inspect_model(model)
    measure = measure or (lambda text: measure_calibration(str(model), text, 2))
    return default_config(info, hobbitpy.OffloadConfig(**chosen), ContextShape(n_ctx=256), available, measure, score,
                          2)


def test_a_failed_measurement_is_kept_and_the_copy_made_for_it_removed(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    copy = default_companion_path(model, LOW_TYPE)

    def read_fails(reference, config, stop_beyond):
        assert copy.is_file()  # made before the ladder is measured
        raise ExpertReadError(f"{copy}: could not read expert 3 of layer 1 (test)")

    served, line = _default_of(model, SOME_MEMORY, read_fails)
    assert served.low is None and "(exact)" in line and "could not be measured" in line and "expert 3" in line, line
    assert not copy.exists()  # made for nothing: removed
    info = hobbitpy.inspect_model(model)
    assert "expert 3" in remembered_failure(model, info, calibration_text()).why
    assert load_calibration(model, info, calibration_text()) is not None  # the model's own measurement is kept

    # the next run with no more memory: no copy made, nothing measured, the same line's cause
    def never(*args):
        raise AssertionError("measured again")

    served, line = _default_of(model, SOME_MEMORY, never, measure=never)
    assert served.low is None and "with as much memory or more" in line and "expert 3" in line, line
    assert not copy.exists()

    # with more memory: measured again, and what it decides holds (a copy only where it is served)
    served, line = _default_of(model, MORE_MEMORY, lambda reference, config, stop_beyond: compare_ladder(
        str(model), reference, config, 2, stop_beyond))
    assert "could not be measured" not in line and "measuring" not in line, line
    assert copy.exists() == (served.low is not None), line
    assert remembered_failure(model, info, calibration_text()) is None  # a measurement supersedes it


def test_an_interrupted_measurement_removes_the_copy_and_keeps_no_failure(tmp_path):
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)

    def interrupted(reference, config, stop_beyond):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _default_of(model, SOME_MEMORY, interrupted)
    assert not default_companion_path(model, LOW_TYPE).exists()
    assert remembered_failure(model, hobbitpy.inspect_model(model), calibration_text()) is None


def test_a_copy_whose_loss_cannot_be_priced_is_placed_by_the_routers_weight_and_not_priced_again(tmp_path, monkeypatch):
    """Where the stock pass for the experts' inputs sees no expert matmul (a backend whose expert
    matmuls the importance matrix's callback does not know), every expert is taken to lose alike at
    that copy: its ladders are placed by the routers' weight, and that is kept, so a run with less
    memory, which measures a ladder of its own over the copy, does not try the pass again."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    info = hobbitpy.inspect_model(model)
    priced = []  # the copies whose loss was priced, in turn

    def no_expert_matmul_seen(model_path, *args):
        raise hobbitpy.HobbitError(f"{model_path}: no expert matmul was seen while decoding; no importance matrix")

    def pricing(info, low_path, *args):
        priced.append(pathlib.Path(low_path).name)
        return copy_rounding_error(info, low_path, *args)

    monkeypatch.setattr(default_ladder, "expert_input_power", no_expert_matmul_seen)
    monkeypatch.setattr(default_ladder, "copy_rounding_error", pricing)
    measured = []  # (the copy, experts at the model's precision) of each ladder measured

    def score(reference, config, stop_beyond):
        measured.append((pathlib.Path(config.low).name, _experts_at_model_precision(info, model, config)))
        return compare_ladder(str(model), reference, config, 2, stop_beyond)

    q2_k = default_companion_path(model, LOW_TYPE).name
    served, line = _default_of(model, MORE_MEMORY, score)
    kept = load_calibration(model, info, calibration_text())
    assert priced == [q2_k] and served.low is not None, (priced, line)
    assert (kept.rounding_error[LOW_TYPE] == 1).all()
    np.testing.assert_allclose(np.array(served.importance), kept.importance, rtol=1e-5)

    measured.clear()
    _default_of(model, SOME_MEMORY, score)
    # a Q2_K ladder of its own, some experts at the model's precision, placed as kept: not priced again
    assert any(name == q2_k and n > 0 for name, n in measured), measured
    assert priced.count(q2_k) == 1 and len(set(priced)) == len(priced), priced


@pytest.mark.slow  # (the run under a cap below may reach the Q3_K ladder too)
def test_the_default_tries_a_q3_k_ladder_where_the_q2_k_one_is_beyond_the_limit(tmp_path):
    """Measured, on the shipped model: with SOME_MEMORY the ladder over a Q2_K copy diverges
    beyond the limit and the one over a Q3_K copy (fewer experts at the model's precision, each
    low one closer to it) within: the Q3_K ladder serves, the Q2_K copy made for it goes, both
    verdicts are kept and a second run measures nothing. With MORE_MEMORY the Q2_K ladder is
    within: it serves, and no Q3_K copy is made or measured."""
    model = tmp_path / "some" / "m.gguf"
    model.parent.mkdir()
    shutil.copy(MODEL, model)
    scored = []

    def score(reference, config, stop_beyond):
        scored.append(config.low)
        return compare_ladder(str(model), reference, config, 2, stop_beyond)

    served, line = _default_of(model, SOME_MEMORY, score)
    q2, q3 = default_companion_path(model, "Q2_K"), default_companion_path(model, "Q3_K")
    assert served.low == str(q3) and "from a Q3_K copy" in line and f"(at most {MAX_MEAN_KL:g})" in line, line
    assert q3.is_file() and not q2.exists()
    ladders = load_calibration(model, hobbitpy.inspect_model(model), calibration_text()).ladders
    assert any(p.low == "Q2_K" and not p.within for p in ladders) and any(p.low == "Q3_K" and p.within for p in ladders)
    assert {pathlib.Path(s).name for s in scored} == {q2.name, q3.name}

    def never(*args):
        raise AssertionError("measured again")

    again, line = _default_of(model, SOME_MEMORY, never, measure=never)
    assert again.low == str(q3) and not q2.exists(), line

    model = tmp_path / "more" / "m.gguf"
    model.parent.mkdir()
    shutil.copy(MODEL, model)
    scored.clear()
    served, line = _default_of(model, MORE_MEMORY, score)
    assert served.low == str(default_companion_path(model, "Q2_K")) and "from a Q2_K copy" in line, line
    assert not default_companion_path(model, "Q3_K").exists()
    assert all(pathlib.Path(s).name.endswith("Q2_K.gguf") for s in scored), scored


def test_a_ladder_far_beyond_the_limit_leaves_the_next_type_untried(tmp_path):
    """Where the Q2_K ladder diverges more than NEXT_TYPE_GAIN times the limit, a Q3_K copy cannot
    bring it within: none is made or measured (at real size tens of minutes), the model's own
    experts serve and the line says why. The shipped model is ten times less sensitive than a
    model with real outlier channels (docs/BENCHMARKS.md), so its measured divergences are
    scaled by ten here, as such a model measures them.
    Each measurement stops once the calibration text can no longer end within what decides (at
    real size a window is a pass through every expert): the ladder once sure to be beyond
    NEXT_TYPE_GAIN times the limit, dynamic precision once sure to be beyond the limit; the whole
    text measured gives the same decisions."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    scored = []  # (the copy's name, stop_beyond, the comparison, the reference's tokens)
    whole = []  # the first measurement that stopped, made again over the whole text

    def score_ten_times_as_sensitive(reference, config, stop_beyond):
        c = compare_ladder(str(model), reference, config, 2, stop_beyond / 10)
        scored.append((pathlib.Path(config.low).name, stop_beyond, c, len(reference.ids) - 1))
        if not c.complete and not whole:
            whole.append(compare_ladder(str(model), reference, config, 2))
        return dataclasses.replace(c, mean_kl=10 * c.mean_kl)

    served, line = _default_of(model, SOME_MEMORY, score_ten_times_as_sensitive)
    kept = load_calibration(model, hobbitpy.inspect_model(model), calibration_text())
    ladders = [p for p in kept.ladders if not p.dynamic]
    assert ladders and all(p.low == "Q2_K" and p.mean_kl > NEXT_TYPE_GAIN * MAX_MEAN_KL for p in ladders), ladders
    # dynamic precision over the Q2_K copy is measured instead, at each of its thresholds (beyond too,
    # ten times as sensitive)
    dynamic = [p for p in kept.ladders if p.dynamic]
    assert {(p.t1, p.t2) for p in dynamic} == set(DYNAMIC_THRESHOLDS) and not any(p.within for p in dynamic), dynamic
    assert "dynamic precision over Q2_K measured" in line, line
    assert served.low is None and "(exact)" in line and "the ladder over Q3_K not tried" in line, line
    # the model's own experts, through the cache that keeps what the calibration weighed most
    _served_with_kept_prior(model, served, kept)
    assert all(name.endswith("Q2_K.gguf") for name, *_ in scored), scored
    assert not default_companion_path(model, "Q2_K").exists() and not default_companion_path(model, "Q3_K").exists()

    # stopped early, and said so; the whole text measures more, as far beyond what decided
    n_dynamic = len(DYNAMIC_THRESHOLDS)
    assert [stop for _, stop, _, _ in scored] == ([NEXT_TYPE_GAIN * MAX_MEAN_KL] * (len(scored) - n_dynamic)
                                                  + [MAX_MEAN_KL] * n_dynamic)
    stopped = [(stop, c, n_text) for _, stop, c, n_text in scored if not c.complete]
    assert stopped and sum(p.at_least for p in kept.ladders) == len(stopped) and "at least" in line, (scored, line)
    stop, c, n_text = stopped[0]
    assert 0 < c.n_tokens < n_text and 10 * c.mean_kl > stop
    assert whole[0].complete and whole[0].n_tokens == n_text
    assert whole[0].mean_kl >= c.mean_kl and 10 * whole[0].mean_kl > stop, (whole, c)


def _served_with_kept_prior(model: pathlib.Path, served: hobbitpy.OffloadConfig, kept: Calibration) -> None:
    """The model's own experts the default serves go through the cache that keeps what the
    calibration weighed most, as every run serving them with no policy chosen does."""
    info = hobbitpy.inspect_model(model)
    assert served.policy is None and served.n_level == 1, served
    prior, line = with_kept_prior(info, served)
    assert prior.policy == CACHE_POLICY and prior.popularity == tuple(map(tuple, kept_importance(kept.importance)))
    assert str(importance_path(model)) in line


def test_the_model_own_experts_take_the_kept_calibration_as_their_cache_prior(tmp_path):
    """`--exact` and `--cache-mb` runs (no policy chosen) serve the model's own experts through the
    cache the default serves them through, where the default has kept a calibration next to the
    model: LFU, the calibration's importance its prior and the order the pools are filled in (at
    real size 1.28x an LRU cache's decode under 12 GiB). Stock's logits all the same; a chosen policy is kept."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    info = hobbitpy.inspect_model(model)

    def run(**chosen):
        config = hobbitpy.OffloadConfig(auto=False, cache_mb=info.expert_bytes_total / 3 / MB, **chosen)
        with hobbitpy.Llama(model, offload=config, n_ctx=256, n_threads=2, logits_all=True, verbose=False) as llm:
            llm.eval(llm.tokenize(PROMPT.encode()))
            return llm.offload_config, llm.offload_stats(), np.array(llm.scores[:llm.n_tokens])

    cold, cold_stats, logits = run()  # nothing kept: the runtime's own policy, nothing read before it is wanted
    assert cold.policy is None and cold.popularity is None and cold_stats["warm_loads"] == 0, cold_stats
    kept = measure_calibration(str(model), calibration_text(), 2)
    save_calibration(model, info, calibration_text(), kept)
    served, stats, prior_logits = run()
    assert served.policy == CACHE_POLICY, served
    assert served.popularity == tuple(map(tuple, kept_importance(kept.importance)))
    assert stats["warm_loads"] > 0 and "the routers select most" in stats["reason"], stats
    assert np.array_equal(prior_logits, logits)
    chosen, chosen_stats, chosen_logits = run(policy="lru")
    assert chosen.policy == "lru" and chosen.popularity is None and chosen_stats["warm_loads"] == 0, chosen_stats
    assert "select most" not in chosen_stats["reason"] and np.array_equal(chosen_logits, logits)


# a memory whose expert cache holds the experts that carry all but a few % of the routers' weight on
# the calibration text (a two-level budget of 14.6 MB for experts of 19 MB), below DYNAMIC_MIN_MISSED
FEW_MISSES_MEMORY = 46 * MB


def test_dynamic_precision_is_not_tried_where_the_cache_leaves_few_misses(tmp_path):
    """Where the expert cache holds the experts that carry all but a little of the routers' weight
    (less than DYNAMIC_MIN_MISSED left to the disk), the model's own experts decode faster than
    dynamic precision (at real size with no cap: 1.14x; docs/BENCHMARKS.md). With every ladder
    beyond the limit (the shipped model's divergences scaled by ten, as a model with real outlier
    channels measures them), the default serves them there, warmed by the calibration's weight,
    and measures no dynamic precision; with less memory, where more is missed, it does."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    scored = []

    def score_ten_times_as_sensitive(reference, config, stop_beyond):
        scored.append(config.hits)
        c = compare_ladder(str(model), reference, config, 2, stop_beyond / 10)
        return dataclasses.replace(c, mean_kl=10 * c.mean_kl)

    served, line = _default_of(model, FEW_MISSES_MEMORY, score_ten_times_as_sensitive)
    kept = load_calibration(model, hobbitpy.inspect_model(model), calibration_text())
    missed = re.search(r"the experts that carry (\d+) % of the routers' weight", line)
    assert missed and 100 - int(missed.group(1)) < 100 * DYNAMIC_MIN_MISSED, line
    assert served.low is None and "(exact)" in line and "dynamic precision not tried" in line, line
    assert "exact" not in scored and not any(p.dynamic for p in kept.ladders), (scored, kept.ladders)
    _served_with_kept_prior(model, served, kept)
    assert not default_companion_path(model, "Q2_K").exists()  # made for the ladder, and for nothing

    scored.clear()
    _default_of(model, SOME_MEMORY, score_ten_times_as_sensitive)
    assert "exact" in scored, scored  # more misses: dynamic precision measured


def test_the_budgets_own_ladder_is_measured_first_and_every_expert_low_only_after_it_is_within(tmp_path):
    """Where the budget holds the Q2_K copy and more, the first ladder measured is the budget's
    own. Beyond the limit (ten times as sensitive, as a real model is), every ladder with fewer
    experts at the model's precision is beyond too: nothing else is measured (a real model's
    uniform Q2_K never is within), and a run with less memory takes the verdict (it measures only
    dynamic precision, not tried where the budget leaves few misses). Within, every
    expert at the copy is measured after: within too, no expert would stay at the model's precision."""
    info = hobbitpy.inspect_model(MODEL)
    low_total = low_copy_bytes(info)
    for sensitivity, every_low_measured in ((10, False), (1, True)):
        model = tmp_path / str(sensitivity) / "m.gguf"
        model.parent.mkdir()
        shutil.copy(MODEL, model)
        placed = []  # the ladders measured, as the bytes each was placed for

        def score(reference, config, stop_beyond):
            if config.placed_mb is not None:
                placed.append(round(config.placed_mb * MB))
            c = compare_ladder(str(model), reference, config, 2, stop_beyond / sensitivity)
            return dataclasses.replace(c, mean_kl=sensitivity * c.mean_kl)

        _default_of(model, MORE_MEMORY, score)
        ladders = [p for p in load_calibration(model, info, calibration_text()).ladders if not p.dynamic]
        assert placed and placed[0] > low_total, (placed, low_total)
        assert len(placed) == (2 if every_low_measured else 1), (placed, ladders)
        assert (placed[-1] == low_total) == every_low_measured, (placed, ladders)  # (after the one within)
        assert ladders[-1].within == every_low_measured, ladders  # the budget's own: most at the model's precision
        # kept with the budget it was priced a slack below; every expert at the copy stands for itself
        assert ladders[-1].stands_for >= ladders[-1].n_high and all(p.stands_for is None for p in ladders[:-1]), ladders

        if not every_low_measured:  # less memory: fewer experts at the model's precision, settled by the verdict
            hits_scored = []
            _default_of(model, SOME_MEMORY, lambda r, c, stop: hits_scored.append(c.hits) or score(r, c, stop))
            # only dynamic precision (DYNAMIC_PRICED's hits), tried where the cache leaves more misses
            assert hits_scored and set(hits_scored) == {"exact"}, hits_scored


def _experts_at_model_precision(info: hobbitpy.ModelInfo, model: pathlib.Path, config: hobbitpy.OffloadConfig) -> int:
    """How many experts the Q2_K ladder a measured config is placed as keeps at the model's
    precision (-1: dynamic precision, placed by no budget)."""
    if config.placed_mb is None:
        return -1
    return ladder_placement(info, layer_expert_bytes(model), round(config.placed_mb * MB),
                            np.array(config.importance), LOW_TYPE)[1]


@pytest.mark.parametrize("n_beyond", [1, 2])
def test_where_the_ladder_a_slack_below_is_just_beyond_those_nearer_the_budget_are_measured(tmp_path, n_beyond):
    """The ladder priced a slack below the budget's own keeps fewer experts at the model's
    precision than the budget holds: where it measures beyond the limit, the one half a slack below
    is measured, and where that is beyond too the budget's own; the first within serves (the
    real-size hardened Mixtral with no cap measured 0.0123 nats with the slack's 174 experts at the
    model's precision, 0.0067 with half a slack's 179, its budget's 184). Here the first n_beyond
    ladders with experts at the model's precision are given just beyond the limit (1.1 and 1.05
    times it), the next within (0.9 times), each measured first. Not a scale of the measured
    divergences: on the shipped model the half-slack ladder (one expert more at the model's
    precision) measures 0.906 of the slack's on an Intel Xeon and above 1/1.1 of it on the AMD
    EPYC machines before, so a scale that puts the slack's at 1.1 times the limit posed one case
    on one CPU and the other on the next. Kept: a later run with as much memory, or more,
    measures nothing, and one with up to half a slack less neither where the half-slack ladder
    was within."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    info = hobbitpy.inspect_model(model)
    ladders = []  # (experts at the model's precision, the divergence the default was given)
    scale = []
    given = (1.1, 1.05)[:n_beyond] + (0.9,)

    def score(reference, config, stop_beyond):
        n_high = _experts_at_model_precision(info, model, config)
        c = compare_ladder(str(model), reference, config, 2)
        if not scale:  # the first ladder measured (the slack's): every expert at the copy scaled as it is
            scale.append(given[0] * MAX_MEAN_KL / c.mean_kl)
        if n_high <= 0:
            return dataclasses.replace(c, mean_kl=scale[0] * c.mean_kl)
        ladders.append((n_high, given[min(len(ladders), len(given) - 1)] * MAX_MEAN_KL))
        return dataclasses.replace(c, mean_kl=ladders[-1][1])

    served, line = _default_of(model, MORE_MEMORY, score)
    assert len(ladders) == n_beyond + 1 and [n for n, _ in ladders] == sorted({n for n, _ in ladders}), ladders
    n_within, kl_within = ladders[-1]
    assert served.low == str(default_companion_path(model, LOW_TYPE)), line
    n_served = int(re.search(r"the (\d+) of \d+ experts that lose most", line).group(1))
    assert n_served == n_within if n_beyond == 2 else n_served > n_within, (line, ladders)
    assert f"{kl_within:.4f} nats" in line, line
    calibration = load_calibration(model, info, calibration_text())
    kept = [p for p in calibration.ladders if not p.dynamic and p.n_high > 0]
    assert [p.n_high for p in kept] == [n for n, _ in ladders] and {p.stands_for for p in kept} == {n_served}, kept
    # placed by what each expert loses at the copy, priced once and kept with the verdicts
    assert set(calibration.rounding_error) == {LOW_TYPE}
    np.testing.assert_allclose(np.array(served.importance), calibration.order(LOW_TYPE), rtol=1e-5)

    def never(*args):
        raise AssertionError("measured again")

    memories = [MORE_MEMORY, MORE_MEMORY + info.expert_bytes]
    if n_beyond == 1:  # a run finding up to half a slack less
        memories.append(MORE_MEMORY - info.expert_bytes)
    for memory in memories:
        again, line = _default_of(model, memory, never, measure=never)
        assert again.low == served.low and f"{kl_within:.4f} nats" in line, (memory, line)


def test_a_ladder_raises_the_experts_that_lose_most_at_the_copy_first(tmp_path):
    """Measured on the hardened model (outlier channels: its Q2_K costs what a real model's does),
    a ladder over its Q2_K copy with half the bytes above the copy's at the model's precision:
    placed in the default's order (the routers' weight times what each expert loses at Q2_K,
    Calibration.order) it diverges less than half as much as placed by the routers' weight alone
    (measured 0.0139 and 0.0333 nats): the routers rank three first-layer experts that lose most
    130th to 177th."""
    model = tmp_path / "h.gguf"
    shutil.copy(HARDENED, model)
    info = hobbitpy.inspect_model(model)
    calibration = measure_calibration(str(model), calibration_text(), 2)
    low = prepare_companion(model, LOW_TYPE, default_companion_path(model, LOW_TYPE), progress=False)
    error = copy_rounding_error(info, low, calibration.reference, 2)
    assert error.shape == calibration.importance.shape and (error > 0).all()
    calibration = calibration.with_rounding_error(LOW_TYPE, error)
    low_total = low_copy_bytes(info)
    budget = low_total + (info.expert_bytes_total - low_total) // 2
    divergence = {}
    for name, order in (("default", calibration.order(LOW_TYPE)), ("routers", calibration.importance)):
        config = hobbitpy.OffloadConfig(low=str(low), hits="found", importance=tuple(map(tuple, order.tolist())),
                                        cache_mb=budget / MB, auto=False)
        divergence[name] = compare_ladder(str(model), calibration.reference, config, 2).mean_kl
    assert divergence["default"] < divergence["routers"] / 2, divergence


def test_dynamic_precision_serves_where_the_ladders_are_beyond_the_limit(tmp_path):
    """Measured, on the shipped model: with LESS_MEMORY the ladder over a Q2_K copy (few experts
    at the model's precision) diverges more than NEXT_TYPE_GAIN times the limit, so no Q3_K copy
    is tried, and HOBBIT's dynamic precision over the same copy (the model's own experts for
    every hit, the copy for a miss a token weighs less) measures within: it serves, keeps its
    copy, runs, and a second run measures nothing. With SOME_MEMORY a ladder is within and wins
    (test_the_default_tries_a_q3_k_ladder_where_the_q2_k_one_is_beyond_the_limit)."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    scored = []

    def score(reference, config, stop_beyond):
        scored.append(config.hits)
        return compare_ladder(str(model), reference, config, 2, stop_beyond)

    served, line = _default_of(model, LESS_MEMORY, score)
    copy = default_companion_path(model, "Q2_K")
    assert served.low == str(copy) and served.hits == "at-least" and served.importance is None, served
    assert "HOBBIT's dynamic precision" in line and "the ladder memory allows" in line, line
    kept = load_calibration(model, hobbitpy.inspect_model(model), calibration_text())
    ladder = kept.verdict(0, "Q2_K")
    # every expert of the ladder at the copy: the order experts would be raised in changes nothing,
    # and what the copy loses expert by expert (a stock pass, then one over both files) is not priced
    assert kept.rounding_error == {}, kept.rounding_error
    # served with the first thresholds (the fewest bytes a token) that measured within
    thresholds = (served.t1, served.t2)
    first = DYNAMIC_THRESHOLDS.index(thresholds)
    assert ladder.mean_kl > NEXT_TYPE_GAIN * MAX_MEAN_KL and kept.dynamic_verdict("Q2_K", thresholds).within, kept.ladders
    assert not any(kept.dynamic_verdict("Q2_K", t).within for t in DYNAMIC_THRESHOLDS[:first]), kept.ladders
    # priced with every selection the rule sends low served low (hits "exact"), whatever the cache holds
    assert scored[-1] == "exact" and copy.is_file() and not default_companion_path(model, "Q3_K").exists()

    def never(*args):
        raise AssertionError("measured again")

    again, _ = _default_of(model, LESS_MEMORY, never, measure=never)
    assert again == served
    # the next layer's predicted experts read ahead, unless the user chose a depth
    assert served.prefetch_layers == DYNAMIC_PREFETCH_LAYERS > 0, served
    assert _default_of(model, LESS_MEMORY, never, measure=never, prefetch_layers=2)[0].prefetch_layers == 2
    # the expert cache keeps the experts the calibration weighed most (warmed first), by CACHE_POLICY
    assert served.policy == CACHE_POLICY and served.popularity == tuple(map(tuple, kept_importance(kept.importance)))
    # in half the experts' memory (this machine has room for all of them, then warmed at the model's precision)
    half = dataclasses.replace(served, cache_mb=hobbitpy.inspect_model(model).expert_bytes_total / 2 / MB)
    with hobbitpy.Llama(model, offload=half, n_ctx=256, n_threads=2, verbose=False) as llm:
        llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
        stats = llm.offload_stats()
    assert stats["served"][1] > 0 and stats["expert_misses"] > 0, stats


def test_a_copy_that_cannot_be_made_leaves_dynamic_precision_over_the_one_at_hand(tmp_path):
    """With SOME_MEMORY the Q2_K ladder measures beyond the limit but close enough for a Q3_K copy
    to bring it within (test_the_default_tries_a_q3_k_ladder_where_the_q2_k_one_is_beyond_the_limit).
    Where that copy can be neither found nor made (here --no-prepare beside the Q2_K copy `prepare`
    made; a disk without room for it alike), dynamic precision over the Q2_K copy is measured and
    serves where within, else the model's own experts do; the line says why no Q3_K ladder was.
    The next start measures nothing (at real size the model's own pass is a minute and more)."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    q2, q3 = default_companion_path(model, "Q2_K"), default_companion_path(model, "Q3_K")
    prepare_companion(model, "Q2_K", q2, threads=2, progress=False)
    scored = []

    def score(reference, config, stop_beyond):
        scored.append(config.hits)
        return compare_ladder(str(model), reference, config, 2, stop_beyond)

    served, line = _default_of(model, SOME_MEMORY, score, prepare=False)
    kept = load_calibration(model, hobbitpy.inspect_model(model), calibration_text())
    ladders = [p for p in kept.ladders if not p.dynamic]
    assert ladders and not ladders[-1].within and ladders[-1].mean_kl <= NEXT_TYPE_GAIN * MAX_MEAN_KL, kept.ladders
    assert all(p.low == "Q2_K" for p in kept.ladders), kept.ladders
    assert "the ladder over Q3_K not tried" in line and "--no-prepare" in line, line
    dynamic = [p for p in kept.ladders if p.dynamic]
    assert dynamic and scored[-1] == "exact", (kept.ladders, scored)  # priced as DYNAMIC_PRICED serves it
    if any(p.within for p in dynamic):
        assert served.low == str(q2) and served.hits == "at-least" and "HOBBIT's dynamic precision" in line, line
    else:
        assert served.low is None and "(exact)" in line, line
    assert q2.is_file() and not q3.exists()  # the user's copy kept: it was not made for this run

    def never(*args):
        raise AssertionError("measured again")

    again, again_line = _default_of(model, SOME_MEMORY, never, measure=never, prepare=False)
    assert again == served and again_line == line


def test_a_verdict_measured_with_far_more_memory_does_not_send_the_run_to_the_next_type(tmp_path):
    """A ladder measured beyond the limit with MORE_MEMORY (its divergences scaled so that it is
    just beyond: near enough for a Q3_K copy, which --no-prepare keeps from being made there)
    settles the smaller ladder LESS_MEMORY allows as beyond too, but only from below: that one
    diverges more than NEXT_TYPE_GAIN times the limit. The run with LESS_MEMORY measures its own
    ladder (once sure to be beyond NEXT_TYPE_GAIN times the limit), and neither makes nor measures
    a Q3_K copy; a later run with as much memory measures nothing (the real-size hardened Mixtral
    with no cap measured 174 experts at the model's precision at 0.0123 nats; taken for the
    12 GiB ladder, which keeps none, it made a 19.4 GB Q3_K copy there)."""
    model = tmp_path / "m.gguf"
    shutil.copy(MODEL, model)
    info = hobbitpy.inspect_model(model)
    q2, q3 = default_companion_path(model, "Q2_K"), default_companion_path(model, "Q3_K")
    prepare_companion(model, "Q2_K", q2, threads=2, progress=False)
    scale = []
    scored = []  # (the copy's name, experts at the model's precision or -1, stop_beyond, the scaled divergence)

    def score(reference, config, stop_beyond):
        n_high = _experts_at_model_precision(info, model, config)
        if not scale:  # the first ladder measured (MORE_MEMORY's, a slack below): twice the limit
            scale.append(2 * MAX_MEAN_KL / compare_ladder(str(model), reference, config, 2).mean_kl)
        c = compare_ladder(str(model), reference, config, 2, stop_beyond / scale[0])
        scored.append((pathlib.Path(config.low).name, n_high, stop_beyond, scale[0] * c.mean_kl))
        return dataclasses.replace(c, mean_kl=scale[0] * c.mean_kl)

    _, line = _default_of(model, MORE_MEMORY, score, prepare=False)
    assert "the ladder over Q3_K not tried" in line and "--no-prepare" in line, line
    kept = load_calibration(model, info, calibration_text())
    more = [p for p in kept.ladders if not p.dynamic]
    assert more and all(MAX_MEAN_KL < p.mean_kl <= NEXT_TYPE_GAIN * MAX_MEAN_KL for p in more), more
    n_more = min(p.n_high for p in more)
    # (taken as it is, that verdict would settle the ladder LESS_MEMORY allows and send the run to Q3_K)
    assert kept.verdict(0, "Q2_K", 0) == more[0]

    scored.clear()
    served, line = _default_of(model, LESS_MEMORY, score)
    ladders = [(n, stop, kl) for name, n, stop, kl in scored if n >= 0]
    assert len(ladders) == 1 and ladders[0][0] < n_more, (scored, n_more)
    _, stop, kl = ladders[0]
    assert stop == NEXT_TYPE_GAIN * MAX_MEAN_KL < kl, ladders
    assert all(name == q2.name for name, *_ in scored) and not q3.exists(), scored
    assert "the ladder memory allows" in line and "from a Q3_K copy" not in line, line
    assert served.low in (None, str(q2)), served  # dynamic precision over Q2_K, or the model's own experts

    def never(*args):
        raise AssertionError("measured again")

    again, again_line = _default_of(model, LESS_MEMORY, never, measure=never)
    assert again == served and again_line == line


def test_dynamic_precision_serves_the_first_thresholds_within_the_limit(tmp_path):
    """Dynamic precision's thresholds are tried the fewest bytes a token first: each measured once
    and kept, the first within the limit served, none after it measured. Measured on the shipped
    model, its divergences scaled so that the first thresholds (skips) measure beyond and the next
    (every selection but a token's first low, none skipped) within. Thresholds whose successor, which
    sends low and skips fewer selections, measured beyond are not measured."""
    info = hobbitpy.inspect_model(MODEL)
    thresholds_of = {}  # the thresholds measured, in order, with their unscaled mean KL

    def score_scaled(scale, model):
        """Dynamic precision's divergence (whole text) times scale; a ladder's as measured."""
        def score(reference, config, stop_beyond):
            if config.hits != "exact":  # a ladder (its hits "found"): beyond at LESS_MEMORY
                return compare_ladder(str(model), reference, config, 2, stop_beyond)
            assert config.skip_cached  # priced with every selection it skips skipped, whatever is cached
            c = compare_ladder(str(model), reference, config, 2)
            thresholds_of[(config.t1, config.t2)] = c.mean_kl
            return dataclasses.replace(c, mean_kl=scale * c.mean_kl)
        return score

    # every one beyond: each measured, the model's own experts serve
    model = tmp_path / "all" / "m.gguf"
    model.parent.mkdir()
    shutil.copy(MODEL, model)
    served, line = _default_of(model, LESS_MEMORY, score_scaled(10 ** 6, model))
    assert served.low is None and list(thresholds_of) == list(DYNAMIC_THRESHOLDS), (thresholds_of, line)
    kl = [thresholds_of[t] for t in DYNAMIC_THRESHOLDS]
    assert kl[0] > kl[1] > 0, kl  # skips diverge more
    assert not default_companion_path(model, "Q2_K").exists()

    # scaled between the first two: the second serves, the third is not measured
    model = tmp_path / "between" / "m.gguf"
    model.parent.mkdir()
    shutil.copy(MODEL, model)
    thresholds_of.clear()
    scale = MAX_MEAN_KL / (kl[0] * kl[1]) ** 0.5
    served, line = _default_of(model, LESS_MEMORY, score_scaled(scale, model))
    assert list(thresholds_of) == list(DYNAMIC_THRESHOLDS[:2]), thresholds_of
    assert (served.t1, served.t2) == DYNAMIC_THRESHOLDS[1] and served.hits == "at-least" and not served.skip_cached
    assert f"T1 = {DYNAMIC_THRESHOLDS[1][0]:g}" in line and "HOBBIT's dynamic precision" in line, line
    kept = load_calibration(model, info, calibration_text())
    assert not kept.dynamic_verdict("Q2_K", DYNAMIC_THRESHOLDS[0]).within
    assert kept.dynamic_verdict("Q2_K", DYNAMIC_THRESHOLDS[1]).within
    assert kept.dynamic_verdict("Q2_K", DYNAMIC_THRESHOLDS[2]) is None

    def never(*args):
        raise AssertionError("measured again")

    assert _default_of(model, LESS_MEMORY, never, measure=never)[0] == served

    # the second kept beyond, the third not measured yet: only the third is (the first, which
    # sends low and skips every selection the second does, is beyond as surely)
    path = importance_path(model)
    data = json.loads(path.read_text())
    second = {"t1": DYNAMIC_THRESHOLDS[1][0], "t2": DYNAMIC_THRESHOLDS[1][1]}
    data["ladders"] = [dict(p, mean_kl=10 * MAX_MEAN_KL) if p.get("dynamic") and {k: p[k] for k in second} == second
                       else p for p in data["ladders"] if not (p.get("dynamic") and p["t1"] == DYNAMIC_THRESHOLDS[0][0]
                                                              and p["t2"] == DYNAMIC_THRESHOLDS[0][1])]
    path.write_text(json.dumps(data))
    thresholds_of.clear()
    served, line = _default_of(model, LESS_MEMORY, score_scaled(1, model))
    assert list(thresholds_of) == [DYNAMIC_THRESHOLDS[2]], thresholds_of
    assert (served.t1, served.t2) == DYNAMIC_THRESHOLDS[2], line


def _run(model, cap: MemoryCap, *flags: str) -> subprocess.CompletedProcess:
    # the model's pages are charged to the cap only when its run reads them in
    for path in model.parent.glob(f"{model.stem}*.gguf"):
        drop_from_page_cache(path)
    cmd = [sys.executable, "-m", "hobbitpy", "run", str(model), "-p", PROMPT, "-n", "8", "--temp", "0", "--no-echo",
           "--threads", "2", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=cap.enter)


def test_run_under_a_cap_measures_the_ladder_once_serves_it_within_the_limit_and_stays_exact_when_asked(tmp_path):
    # a trained model: on random weights every expert at Q2_K moves the outputs as far as any
    # (0.06 nats with 28 of 32 at Q8_0), on a trained one those the routers weigh least matter
    # least. ref-mixtral widened to experts of 2048 neurons (zeros: the same outputs, its
    # quantized blocks unchanged): experts of 77 MB in Q8_0 and a Q2_K copy of 20 MB, in
    # proportion to the rest of the run as a real model's
    src = tmp_path / "src" / "m.gguf"
    src.parent.mkdir()
    inflate(MODEL, src, 2048, progress=False)
    model = tmp_path / "m.gguf"
    shutil.copy(src, model)
    info = hobbitpy.inspect_model(model)
    cap = MemoryCap.create(f"hobbitpy-default-{os.getpid()}")
    if cap is None:
        pytest.fail("no writable memory cgroup here: the cap cannot be held")
    try:
        cap.set_limit(None)
        stock = _run(model, cap)
        assert stock.returncode == 0 and "no offload" in stock.stderr, stock.stderr
        # a cap whose expert cache holds 92 % of the experts: the Q2_K copy of every expert fits, and
        # most experts at the model's precision beside it. Where a cap puts the cache is the plan's
        # to say: a probe under the stock run's peak tells what the process holds when it plans
        # and what the plan keeps for the rest
        probe_limit = cap.peak_bytes()
        cap.set_limit(probe_limit)
        probe = _run(model, cap, "--exact")
        assert probe.returncode == 0, probe.stderr[-3000:]
        available, rest = map(int, re.search(r"from (\d+) MB available; (\d+) MB for the rest", probe.stderr).groups())
        low_total = low_copy_bytes(info)
        target = low_total + 0.92 * (info.expert_bytes_total - low_total)
        roomy_limit = int(probe_limit - available * MB + rest * MB + target)
        cap.set_limit(roomy_limit)
        first = _run(model, cap)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "measuring the model on hobbitpy's calibration text" in first.stderr
        assert "measuring the default ladder" in first.stderr
        assert f"making a {LOW_TYPE} copy" in first.stderr and "every expert in memory" in first.stderr, first.stderr
        assert default_companion_path(model, LOW_TYPE).is_file() and importance_path(model).is_file()
        # both readable as any file the user makes there (the umask's, not a private temporary's)
        umask = os.umask(0)
        os.umask(umask)
        for made in (default_companion_path(model, LOW_TYPE), importance_path(model)):
            assert made.stat().st_mode & 0o777 == 0o666 & ~umask, made

        # priced a slack below the budget's own ladder, and the line says so
        assert "at the model's precision, on hobbitpy's calibration text" in first.stderr, first.stderr

        # made once: found next to the model, by a run finding a little less memory too (runs under
        # the same cap differ by about an expert's bytes: fresh-clone CI saw one measure again)
        cap.set_limit(roomy_limit - info.expert_bytes // 2)
        again = _run(model, cap)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "measuring" not in again.stderr and "making" not in again.stderr, again.stderr
        # (its text may differ from the first run's: the budget, and so the experts kept at the
        # model's precision, follow the memory the run finds)
        assert "every expert in memory" in again.stderr and again.stdout.strip()

        for flags in (["--exact"], ["--preset", "lru"]):  # the model's own experts: stock's text
            exact = _run(model, cap, *flags)
            assert exact.returncode == 0, exact.stderr[-3000:]
            assert "expert cache" in exact.stderr and "every expert in memory" not in exact.stderr, exact.stderr
            assert exact.stdout == stock.stdout
            # through the cache the calibration kept primes, unless the flags chose a policy
            assert ("the routers select most" in exact.stderr) == (flags == ["--exact"]), exact.stderr

        # a cap whose cache holds little more than the copy: the ladder it allows (Q2_K for nearly
        # every expert: 0.02-0.05 nats from the model, by the MB the run finds) measures beyond the
        # limit. What serves then is measured too, by the same MB: a ladder over a Q3_K copy where
        # the Q2_K one is within its reach, else HOBBIT's dynamic precision over the copy; the model's
        # own experts where neither is within or can be measured beside the measurement's arrays.
        # The verdicts (and failures) are kept, and the next run takes them without measuring
        target = low_total + 0.1 * (info.expert_bytes_total - low_total)
        tight_limit = int(probe_limit - available * MB + rest * MB + target)
        cap.set_limit(tight_limit)
        tight = _run(model, cap)
        assert tight.returncode == 0, tight.stderr[-3000:]
        # here the room to measure beside the measurement's arrays is a few MB, about what a run's
        # memory varies by (its heap after a pass, the bytes of the placement measured): where a
        # measurement finds none, the model's own experts serve and the failure is kept
        no_room = "could not be measured (no room" in tight.stderr
        if not no_room:
            assert "measuring the default ladder" in tight.stderr, tight.stderr
            assert f"(at most {MAX_MEAN_KL:g})" in tight.stderr, tight.stderr
        q3_ladder, dynamic = "from a Q3_K copy" in tight.stderr, "HOBBIT's dynamic precision" in tight.stderr
        assert ("(exact)" in tight.stderr) != (q3_ladder or dynamic), tight.stderr
        if "(exact)" in tight.stderr:
            if not no_room:  # what a user who would trade quality runs
                assert f"hobbitpy tune {model} --text" in tight.stderr, tight.stderr
            assert tight.stdout == stock.stdout
        # the next run with a little less memory: a verdict beyond the limit settles every ladder
        # with no more experts at the model's precision, dynamic precision's holds for any memory,
        # and a failure for want of room holds for no more memory.
        # (Under the same cap a run finds a MB or two more or less than the last one, one expert at
        # the model's precision more or less: a ladder with more of them is not settled, and is
        # measured; fresh-clone CI saw that.)
        cap.set_limit(tight_limit - 2 * info.expert_bytes)
        kept = _run(model, cap)
        assert kept.returncode == 0, kept.stderr
        assert (f"(at most {MAX_MEAN_KL:g})" in kept.stderr or "with as much memory or more" in kept.stderr), kept.stderr
        if not q3_ladder:  # (a Q3_K ladder within is not settled for fewer experts at the model's precision)
            assert "measuring" not in kept.stderr, kept.stderr
        calibration = load_calibration(model, info, calibration_text())
        # the roomy cap's ladder within, then every expert at Q2_K (beyond); the tight cap's beyond
        ladders = [p for p in calibration.ladders if p.low == LOW_TYPE and not p.dynamic]
        assert ladders[0].n_high == 0 and not ladders[0].within and ladders[-1].within, calibration.ladders
        if "measuring the default ladder" in tight.stderr:
            assert any(0 < p.n_high < ladders[-1].n_high and not p.within for p in ladders), calibration.ladders

        # a model measured afresh under the first cap (room to measure beside the passes' arrays)
        cap.set_limit(roomy_limit)
        other = tmp_path / "other"
        other.mkdir()
        shutil.copy(src, other / "m.gguf")
        refused = _run(other / "m.gguf", cap, "--no-prepare")
        assert refused.returncode == 0, refused.stderr[-3000:]
        assert "--no-prepare" in refused.stderr and "(exact)" in refused.stderr, refused.stderr
        assert not default_companion_path(other / "m.gguf", LOW_TYPE).exists()
        assert refused.stdout == stock.stdout
        # a copy is kept only where it serves (made for a ladder measured beyond, it is removed)
        made = _run(other / "m.gguf", cap)
        assert made.returncode == 0, made.stderr[-3000:]
        assert f"making a {LOW_TYPE} copy" in made.stderr
        copies = [default_companion_path(other / "m.gguf", t) for t in ("Q2_K", "Q3_K")]
        assert sum(c.exists() for c in copies) == ("(exact)" not in made.stderr), made.stderr
    finally:
        cap.remove()
