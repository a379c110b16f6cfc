"""The experts' importance matrix: collected from a stock run (every selection counted once,
in every layer; gate and up seeing the same input), written in llama.cpp's GGUF layout and
read back, and what it buys: ggml's lowest-bit types, closer to the model than without it."""

from __future__ import annotations

import math
import os
import pathlib
import shutil

import gguf
import numpy as np
import pytest

import hobbitpy
from hobbitpy.settings.config import OffloadConfig
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.copies.imatrix import collect_imatrix, load_imatrix, write_imatrix
from hobbitpy.copies.companions import KEY_IMATRIX
from hobbitpy.copies.prepare import prepare_companion

from conftest import MB, hobbitpy_cli

REPO = pathlib.Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "ref-mixtral-Q8_0.gguf"
PROMPTS = REPO / "models" / "trace-prompts.txt"
WINDOW = 128


@pytest.fixture(scope="module")
def with_imatrix(tmp_path_factory):
    """ref-mixtral, its matrix collected on the first half of the shipped prompts, the second
    half held out."""
    folder = tmp_path_factory.mktemp("imatrix")
    model = folder / MODEL.name
    shutil.copy(MODEL, model)
    lines = PROMPTS.read_text().splitlines()
    calibration, held_out = folder / "calibration.txt", folder / "held-out.txt"
    calibration.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    held_out.write_text("\n".join(lines[len(lines) // 2:]) + "\n")
    proc = hobbitpy_cli("imatrix", str(model), "--text", str(calibration), "--ctx", str(WINDOW), "--threads", "2", timeout=600)
    assert proc.returncode == 0, proc.stderr
    path = folder / "ref-mixtral-Q8_0.imatrix.gguf"
    assert f"wrote {path}" in proc.stdout
    assert proc.stderr == "", proc.stderr  # llama.cpp's own log lines (loading, closing) stay off the terminal
    return model, path, calibration, held_out


def test_every_selection_is_counted_once_in_every_layer(with_imatrix):
    model, path, calibration, _ = with_imatrix
    info = hobbitpy.inspect_model(model)
    n_tokens = len(tokenize_text(model, calibration.read_text()))
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.type").contents() == "imatrix"
    assert reader.get_field("imatrix.datasets").contents() == ["calibration.txt"]
    assert reader.get_field("imatrix.chunk_size").contents() == WINDOW
    assert reader.get_field("imatrix.chunk_count").contents() == math.ceil(n_tokens / WINDOW)
    tensors = {t.name: np.asarray(t.data, np.float64) for t in reader.tensors}
    assert len(tensors) == 2 * 3 * info.n_layer_moe  # sums and counts of gate, up and down, every MoE layer
    for il in range(info.n_layer_moe):
        gate, up, down = (f"blk.{il}.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
        counts = tensors[gate + ".counts"].reshape(-1)
        # every token's every selection, the last layer's too (llama.cpp computes it only for
        # the rows it outputs: the collection asks for every token's)
        assert counts.shape == (info.n_expert,) and counts.sum() == n_tokens * info.n_expert_used
        assert np.array_equal(counts, tensors[up + ".counts"].reshape(-1))
        assert np.array_equal(counts, tensors[down + ".counts"].reshape(-1))
        # gate and up multiply the same input; down the activation, n_ff wide
        assert np.array_equal(tensors[gate + ".in_sum2"], tensors[up + ".in_sum2"])
        assert tensors[gate + ".in_sum2"].size == info.n_expert * info.n_embd
        assert tensors[down + ".in_sum2"].size == info.n_expert * info.n_ff_expert
        assert np.all(tensors[down + ".in_sum2"] >= 0) and tensors[down + ".in_sum2"].sum() > 0
    means = load_imatrix(path)
    assert means["blk.0.ffn_down_exps.weight"].shape == (info.n_expert, info.n_ff_expert)


def test_the_collection_is_deterministic(with_imatrix, tmp_path):
    model, path, calibration, _ = with_imatrix
    again = collect_imatrix(model, calibration, tmp_path / "again.gguf", n_ctx=WINDOW, n_threads=2)
    first, second = load_imatrix(path), load_imatrix(again)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_allclose(first[name], second[name], rtol=1e-5)


@pytest.mark.slow
def test_the_matrix_brings_the_lowest_bit_type_closer_to_the_model(with_imatrix, tmp_path):
    model, path, _, held_out = with_imatrix
    flat = tmp_path / "flat.imatrix.gguf"  # every column weighed alike: what no matrix would mean
    write_imatrix(flat, {name: (np.ones_like(m), np.ones((m.shape[0], 1), np.float32))
                         for name, m in load_imatrix(path).items()}, dataset="none", chunk_count=1, chunk_size=1)
    weighted = prepare_companion(model, "IQ2_XXS", tmp_path / "weighted.gguf", imatrix_path=path, progress=False)
    unweighted = prepare_companion(model, "IQ2_XXS", tmp_path / "flat.gguf", imatrix_path=flat, progress=False)
    assert gguf.GGUFReader(weighted).get_field(KEY_IMATRIX).contents() == path.name
    assert {t.tensor_type.name for t in gguf.GGUFReader(weighted).tensors} == {"IQ2_XXS"}
    ids = tokenize_text(model, held_out.read_text(), 512)
    ref = measure_reference(model, ids, n_ctx=256, n_threads=2)
    total = hobbitpy.inspect_model(weighted).expert_bytes_total
    results = {name: evaluate_against(model, ref, OffloadConfig(high=str(level), cache_mb=2 * total / MB),
                                      n_threads=2)
               for name, level in (("weighted", weighted), ("flat", unweighted))}
    # on held-out text (measured: KL 0.0558 flat -> 0.0505 with the matrix, perplexity 63.80 ->
    # 63.45; on the inflated ref-mixtral of docs/BENCHMARKS.md at 5f63b2a 0.056 -> 0.047)
    assert results["weighted"].mean_kl < 0.95 * results["flat"].mean_kl
    assert results["weighted"].perplexity < results["flat"].perplexity


@pytest.mark.slow
def test_bad_input_is_one_clear_line(with_imatrix, tmp_path):
    model, path, calibration, _ = with_imatrix
    # a lowest-bit type without a matrix says how to make one
    proc = hobbitpy_cli("prepare", str(model), "--low", "IQ2_XXS", "--out", str(tmp_path / "c.gguf"), timeout=600)
    assert proc.returncode == 2 and "IQ2_XXS needs an importance matrix" in proc.stderr
    assert "hobbitpy imatrix" in proc.stderr and "Traceback" not in proc.stderr
    # not a matrix; a matrix of another shape: refused before anything is written
    proc = hobbitpy_cli("prepare", str(model), "--low", "IQ2_XXS", "--imatrix", str(model), "--out", str(tmp_path / "c.gguf"), timeout=600)
    assert proc.returncode == 2 and f"{model}: not an importance matrix" in proc.stderr
    other = tmp_path / "other.imatrix.gguf"
    write_imatrix(other, {name: (m[:, :64].copy(), np.ones((m.shape[0], 1), np.float32))
                          for name, m in load_imatrix(path).items()}, dataset="x", chunk_count=1, chunk_size=1)
    proc = hobbitpy_cli("prepare", str(model), "--low", "IQ2_XXS", "--imatrix", str(other), "--out", str(tmp_path / "c.gguf"), timeout=600)
    assert proc.returncode == 2 and "a matrix of another model?" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c.gguf").exists()
    # imatrix: a missing model, a text that is not UTF-8, an existing output or a symlink there
    proc = hobbitpy_cli("imatrix", str(tmp_path / "missing.gguf"), "--text", str(calibration), timeout=600)
    assert proc.returncode == 2 and "missing.gguf" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    proc = hobbitpy_cli("imatrix", str(model), "--text", str(binary), "--out", str(tmp_path / "m.gguf"), timeout=600)
    assert proc.returncode == 2 and "binary.txt: cannot read it as UTF-8 text" in proc.stderr
    kept = tmp_path / "kept.gguf"
    kept.write_bytes(b"keep")
    link = tmp_path / "link.gguf"
    os.symlink(kept, link)
    for out in (kept, link):
        proc = hobbitpy_cli("imatrix", str(model), "--text", str(calibration), "--out", str(out), timeout=600)
        assert proc.returncode == 2 and f"{out}: already exists" in proc.stderr
    assert kept.read_bytes() == b"keep"
    assert not (tmp_path / "m.gguf").exists()
