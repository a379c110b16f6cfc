"""`hobbitpy eval`: perplexity, KL and top-1 agreement against stock llama.cpp."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

import hobbitpy
from hobbitpy import OffloadConfig
from hobbitpy.cli import main as cli_main
from hobbitpy.analysis.likelihood import FIRST_PART
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.measure.evaluate import evaluate, evaluate_against, measure_reference

from conftest import MB, tiny_model

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"

TEXT = ("The keeper climbed the stairs of the tower every evening, lit the lamp and watched the sea. "
        "Ships passed in the night and the light turned, slow and steady, until the morning came. ") * 3


def test_uniform_model_has_perplexity_n_vocab(model_dir):
    # an all-zero output matrix makes every logit 0: a uniform next-token distribution
    path = tiny_model(model_dir, "llama", zero_output=True)
    info = hobbitpy.inspect_model(path)
    r = evaluate(path, TEXT, OffloadConfig(cache_mb=3 * info.expert_bytes / MB), n_ctx=32, n_threads=2)
    assert r.offloaded
    assert math.isclose(r.perplexity, 32000, rel_tol=1e-9)
    assert r.mean_kl == 0.0 and r.top1_agreement == 1.0


def test_perplexity_agrees_with_token_by_token_scoring(model_dir):
    path = tiny_model(model_dir, "llama")
    r = evaluate(path, TEXT, OffloadConfig(enabled=False), n_ctx=32, compare_to_reference=False, n_threads=2)

    # the same quantity computed another way: one token per decode step, through
    # llama.cpp's logits of the last token, windows restarted by hand
    llm = hobbitpy.Llama(path, offload=OffloadConfig(enabled=False), n_ctx=32, n_batch=1, verbose=False, n_threads=2)
    try:
        ids = llm.tokenize(TEXT.encode(), add_bos=False)
        nll = 0.0
        for i in range(len(ids) - 1):
            if i % 32 == 0:
                llm.reset()
            llm.eval([ids[i]])
            logits = llm.last_logits().astype(np.float64)
            m = logits.max()
            nll += m + math.log(np.exp(logits - m).sum()) - logits[ids[i + 1]]
    finally:
        llm.close()
    assert r.n_tokens == len(ids) - 1
    assert r.mean_kl is None and r.reference_perplexity is None
    # one token at a time takes other kernels than a batch (vector vs matrix products):
    # the logits differ in the last bits, amplified by this random model's large logits
    assert math.isclose(r.perplexity, math.exp(nll / (len(ids) - 1)), rel_tol=2e-3)


def test_offload_at_one_precision_costs_nothing(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "qwen2moe")
    info = hobbitpy.inspect_model(path)
    text = tmp_path / "held-out.txt"
    text.write_text(TEXT)
    out = tmp_path / "eval.json"
    budget = f"{info.min_budget_bytes / MB + 0.0001:.4f}"
    assert cli_main(["eval", str(path), "--text", str(text), "--ctx", "24", "--cache-mb", budget,
                     "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["offloaded"] and r["n_tokens"] > 24
    assert r["perplexity"] == r["reference_perplexity"]
    assert r["mean_kl"] == 0.0 and r["top1_agreement"] == 1.0
    assert r["log_ppl_ratio_se"] == 0.0  # the same bits, token for token
    # the cache's counters come with the result: what the quality was measured with
    assert r["stats"]["expert_misses"] > 0 and r["stats"]["n_substituted"] == 0
    out_text = capsys.readouterr().out
    assert "top-1 agreement       100.00 %" in out_text and "perplexity increase   +0.00 %" in out_text
    assert "expert cache" in out_text and "hit ratio" in out_text


def test_a_comparison_that_may_stop_runs_its_first_window_in_two_parts(model_dir):
    """With stop_beyond, the first window runs its first 1/FIRST_PART, then the rest, the KV
    cache kept between: the model itself measures what one batch measures (the order of sums
    aside; a part evaluated without its context would be far off), and a candidate sure to end
    beyond after the first part stops there (at real size a part is a pass through every expert)."""
    model = MODELS / "ref-deepseek-Q8_0.gguf"
    n_ctx = 64
    ids = tokenize_text(model, TEXT * 2)
    assert len(ids) > 2 * n_ctx
    reference = measure_reference(model, ids, n_ctx=n_ctx, n_threads=2)
    itself = evaluate_against(model, reference, OffloadConfig(enabled=False), n_threads=2, stop_beyond=1.0)
    assert itself.complete and itself.n_tokens == len(ids) - 1
    assert itself.mean_kl < 1e-6 and itself.top1_agreement == 1.0, itself

    f16 = MODELS / "ref-deepseek-F16.gguf"  # the same model at another precision: close, not equal
    whole = evaluate_against(f16, reference, OffloadConfig(enabled=False), n_threads=2)
    stopped = evaluate_against(f16, reference, OffloadConfig(enabled=False), n_threads=2, stop_beyond=1e-12)
    assert whole.complete and 0 < whole.mean_kl < 0.01, whole
    assert not stopped.complete and stopped.n_tokens == n_ctx // FIRST_PART, stopped
    assert 0 < stopped.mean_kl < whole.mean_kl, (stopped, whole)


def test_eval_bad_input(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama")
    assert cli_main(["eval", str(path), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    one = tmp_path / "one.txt"
    one.write_text("a")
    assert cli_main(["eval", str(path), "--text", str(one), "--no-offload"]) == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.slow
def test_eval_under_a_memory_cap_scores_the_reference_first_and_the_candidate_alone(model_dir, tmp_path):
    import os
    import subprocess
    import sys

    from hobbitpy.system.memory_cgroup import MemoryCap

    # the candidate sizes its cache from the memory left when it opens; side by side with the
    # stock reference, the two competed for the cap (the reference's compute buffer got the
    # process OOM-killed, or its mapped weights left the candidate too little to start)
    model = tiny_model(model_dir, "llama", n_embd=256, n_ff=1024, n_expert=32)
    info = hobbitpy.inspect_model(model)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    cap = MemoryCap.create(f"hobbitpy-eval-{os.getpid()}")
    if cap is None:
        pytest.fail("no writable memory cgroup here: the cap cannot be held")
    # --exact: the candidate is the model's own experts, whose budget the cap decides (the
    # default's first use, which measures and makes files in the process, is test_default_ladder's)
    cmd = [sys.executable, "-m", "hobbitpy", "eval", str(model), "--text", str(text), "--ctx", "32", "--threads", "2",
           "--exact"]
    try:
        cap.set_limit(None)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=cap.enter)
        assert p.returncode == 0, p.stderr
        # a cap that holds about half of the experts beside everything else
        limit = int(cap.peak_bytes() - 0.5 * info.expert_bytes_total)
        cap.set_limit(limit)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=cap.enter)
    finally:
        cap.remove()
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "perplexity increase" in p.stdout and "offload on" in p.stdout, p.stdout


def test_tokenizing_the_text_makes_no_context_and_prints_nothing(model_dir, tmp_path, capfd):
    """The text is cut by a vocabulary-only load (tokens.Vocabulary): llama_cpp.Llama made a
    context for it, whose length check printed "n_ctx_seq (512) > n_ctx_train (0)" on every eval."""
    from hobbitpy import ModelFileError
    from hobbitpy.files.tokens import tokenize_text
    from hobbitpy.files.tokens import Vocabulary

    path = tiny_model(model_dir, "llama", n_layer=2, n_expert=4, n_expert_used=2)
    capfd.readouterr()
    ids = tokenize_text(path, TEXT)
    out, err = capfd.readouterr()
    assert len(ids) > 10 and out == "" and err == ""
    with Vocabulary(path) as vocab:
        assert vocab.detokenize(vocab.tokenize(b"the keeper climbed")).decode().strip() == "the keeper climbed"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    try:
        Vocabulary(bad)
        raise AssertionError("a broken file was read as a vocabulary")
    except ModelFileError as e:
        assert "bad.gguf" in str(e)
