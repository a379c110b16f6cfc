"""What runs with no flags when a model's experts do not all fit (default_ladder.py): the
choice itself, and `hobbitpy run` under a real memory cap making what the ladder needs once,
reusing it, and staying exact with --exact, a preset or --no-prepare."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import hobbitpy
from hobbitpy.default_ladder import (LOW_TYPE, MAX_LOW_WEIGHT_SHARE, MIN_HIGH_EXPERT_SHARE, calibration_text, choose,
                                     importance_path, low_copy_layer_bytes, low_weight_share)
from hobbitpy.disk import drop_from_page_cache
from hobbitpy.memcap import MemoryCap
from hobbitpy.prepare import default_companion_path

from conftest import MB, tiny_model

PROMPT = "Once upon a time, in a quiet village by the sea"


def _info(n_layer=4, n_expert=8, n_embd=256, n_ff=1024, bytes_per_weight=34 / 32) -> hobbitpy.ModelInfo:
    expert = int(3 * n_embd * n_ff * bytes_per_weight)
    return hobbitpy.ModelInfo(path="m.gguf", arch="llama", n_layer=n_layer, n_layer_moe=n_layer, n_expert=n_expert,
                              n_expert_used=2, n_embd=n_embd, expert_bytes=expert,
                              expert_bytes_total=n_layer * n_expert * expert, min_budget_bytes=2 * expert,
                              file_bytes=n_layer * n_expert * expert + 10 * MB, uniform=True, n_ff_expert=n_ff,
                              max_slice_bytes=expert // 3)


def test_the_choice_follows_the_memory_and_the_routers_weight():
    info = _info()
    model_bytes = np.full(info.n_layer_moe, info.expert_bytes, np.int64)
    low = low_copy_layer_bytes(info)
    low_total = int(low.sum()) * info.n_expert
    assert 0 < low_total < info.expert_bytes_total
    # no room for a low copy of every expert: the model's own experts
    c = choose(info, model_bytes, low_total - 1, None)
    assert c.settings == {} and "does not fit" in c.reason and "exact" in c.reason
    assert choose(info, model_bytes, None, None).settings == {}
    # room for the copy but for few experts beside it: not worth measuring the routers
    extra = info.expert_bytes - int(low[0])
    few = low_total + int(MIN_HIGH_EXPERT_SHARE * 32 - 1) * extra
    c = choose(info, model_bytes, few, None)
    assert c.settings == {} and f"at most {int(MIN_HIGH_EXPERT_SHARE * 32 - 1)} of 32 experts" in c.reason
    # room for more: decided on the bytes alone until the importance is known
    assert choose(info, model_bytes, low_total + 16 * extra, None).settings["low"] == LOW_TYPE
    # skewed routers: a few experts carry most of the weight, and fit at the model's precision
    skewed = np.full((info.n_layer_moe, info.n_expert), 0.01)
    skewed[:, :2] = 1.0
    budget = low_total + 2 * info.n_layer_moe * extra
    c = choose(info, model_bytes, budget, skewed)
    assert c.settings["low"] == LOW_TYPE and c.settings["hits"] == "found"
    assert np.array_equal(np.array(c.settings["importance"]), skewed) and "every expert in memory" in c.reason
    # even routers: the same budget leaves three quarters of their weight at the low copy
    even = np.ones((info.n_layer_moe, info.n_expert))
    c = choose(info, model_bytes, budget, even)
    assert c.settings == {} and "75 % of the routers' weight" in c.reason
    # a model whose experts are no larger than the low copy
    small = _info(bytes_per_weight=84 / 256)
    assert "no smaller" in choose(small, model_bytes, 10 ** 12, None).reason
    # rows that are not whole blocks of the low type
    assert "not whole" in choose(_info(n_ff=1000), model_bytes, 10 ** 12, None).reason


def test_low_weight_share():
    importance = np.array([[3.0, 1.0], [0.0, 4.0]])
    assert low_weight_share(importance, ((0, 1), (1, 0))) == pytest.approx(1 / 8)
    assert low_weight_share(importance, ((0, 0), (0, 0))) == 0.0
    assert MAX_LOW_WEIGHT_SHARE < 0.5


def test_the_calibration_text_ships_with_the_package():
    text = calibration_text()
    assert len(text.split()) > 1000 and "def " in text and "The LORD is my shepherd" in text


def _run(model, cap: MemoryCap, *flags: str) -> subprocess.CompletedProcess:
    # the model's pages are charged to the cap only when its run reads them in
    for path in model.parent.glob(f"{model.stem}*.gguf"):
        drop_from_page_cache(path)
    cmd = [sys.executable, "-m", "hobbitpy", "run", str(model), "-p", PROMPT, "-n", "8", "--temp", "0", "--no-echo",
           "--threads", "2", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=cap.enter)


def test_run_under_a_cap_makes_the_ladder_once_and_stays_exact_when_asked(model_dir, tmp_path):
    # experts of 3 x 256 x 4096 Q8_0 values: 107 MB in all, a Q2_K copy a third of that
    src = tiny_model(model_dir, "llama", n_embd=256, n_ff=4096, n_expert=8, n_layer=4)
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
        low_total = int(low_copy_layer_bytes(info).sum()) * info.n_expert
        target = low_total + 0.92 * (info.expert_bytes_total - low_total)
        cap.set_limit(int(probe_limit - available * MB + rest * MB + target))
        first = _run(model, cap)
        assert first.returncode == 0, first.stderr[-3000:]
        assert "measuring how much the routers weigh" in first.stderr
        assert f"making a {LOW_TYPE} copy" in first.stderr and "every expert in memory" in first.stderr, first.stderr
        assert default_companion_path(model, LOW_TYPE).is_file() and importance_path(model).is_file()
        # both readable as any file the user makes there (the umask's, not a private temporary's)
        umask = os.umask(0)
        os.umask(umask)
        for made in (default_companion_path(model, LOW_TYPE), importance_path(model)):
            assert made.stat().st_mode & 0o777 == 0o666 & ~umask, made

        again = _run(model, cap)  # made once: found next to the model
        assert again.returncode == 0, again.stderr[-3000:]
        assert "measuring" not in again.stderr and "making" not in again.stderr
        # (its text may differ from the first run's: the budget, and so the experts kept at the
        # model's precision, follow the memory the run finds)
        assert "every expert in memory" in again.stderr and again.stdout.strip()

        for flags in (["--exact"], ["--preset", "lru"]):  # the model's own experts: stock's text
            exact = _run(model, cap, *flags)
            assert exact.returncode == 0, exact.stderr[-3000:]
            assert "expert cache" in exact.stderr and "every expert in memory" not in exact.stderr, exact.stderr
            assert exact.stdout == stock.stdout

        other = tmp_path / "other"
        other.mkdir()
        shutil.copy(src, other / "m.gguf")
        refused = _run(other / "m.gguf", cap, "--no-prepare")
        assert refused.returncode == 0, refused.stderr[-3000:]
        assert "--no-prepare" in refused.stderr and "(exact)" in refused.stderr
        assert not default_companion_path(other / "m.gguf", LOW_TYPE).exists()
        assert refused.stdout == stock.stdout
    finally:
        cap.remove()
