"""A precision ladder: every level may be a companion, the high one included, so the
model file is read for its non-expert weights only; a uniform quant of the model made by
llama.cpp's quantizer serves as a level as it is."""

from __future__ import annotations

import pathlib
import shutil

import gguf
import numpy as np
import pytest

import hobbitpy
from conftest import (ARCHES, EXPERT_SUFFIXES, MB, assert_bit_equal, fast_first, identical_companion, reference,
                      run_logits, tiny_model)
from hobbitpy.copies.quants import make_uniform_quant, source_record_path


def with_garbage_experts(model: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A copy of the model whose routed expert bytes are noise: whatever reads them is wrong."""
    if not out.exists():
        shutil.copyfile(model, out)
        reader = gguf.GGUFReader(out, "r+")
        rng = np.random.default_rng(0)
        for t in reader.tensors:
            if t.name.endswith(EXPERT_SUFFIXES):
                t.data[...] = rng.integers(0, 256, size=t.data.shape, dtype=np.uint8).view(t.data.dtype)
        del reader
    return out


@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_high_companion_serves_every_expert_and_the_model_experts_are_never_read(model_dir, arch):
    path = tiny_model(model_dir, arch)
    high = identical_companion(path, model_dir / f"{path.stem}.high.gguf")
    low = identical_companion(path, model_dir / f"{path.stem}.copy.gguf")
    broken = with_garbage_experts(path, model_dir / f"{path.stem}.garbage-experts.gguf")
    ref_scores, ref_text, _, info = reference(path)
    # stock on the broken file is another model: the test could not pass by reading it
    stock_broken = run_logits(broken, hobbitpy.OffloadConfig(enabled=False))[0]
    assert not np.array_equal(stock_broken, ref_scores)
    for config in (hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, high=str(high)),
                   hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, high=str(high), low=str(low),
                                          t1=0.0, t2=1.0)):
        scores, text, stats, _ = run_logits(broken, config)
        assert_bit_equal(scores, ref_scores)
        assert text == ref_text
        assert stats["bytes_read"] > 0 and stats["expert_inplace"] == 0


def test_ladder_with_every_expert_fitting_keeps_them_all_resident(model_dir):
    path = tiny_model(model_dir, "llama")
    high = identical_companion(path, model_dir / f"{path.stem}.high.gguf")
    info = hobbitpy.inspect_model(path)
    # a budget of exactly every expert: one slot each (integer split, no rounding loss)
    with hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / MB, high=str(high)),
                        n_ctx=64, verbose=False) as llm:
        assert sum(p["n_slot"] for p in llm.pool_stats()) == info.n_layer_moe * info.n_expert


def test_a_uniform_quant_of_the_model_is_a_level(model_dir):
    # llama.cpp's own Q4_K_M: its expert tensors (Q4_K, some down projections Q6_K) serve as
    # the high level over the Q8_0 model, its other tensors are ignored
    path = tiny_model(model_dir, "llama", n_embd=256)  # rows of whole K-quant blocks
    quant, made = make_uniform_quant(path, "Q4_K_M", model_dir / "quants", threads=2)
    assert made and quant.stat().st_size < path.stat().st_size
    again, made = make_uniform_quant(path, "q4_k_m", model_dir / "quants", threads=2)
    assert again == quant and not made  # reused, never rewritten
    info = hobbitpy.inspect_model(path)
    config = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / MB, high=str(quant))
    scores, text, stats, _ = run_logits(path, config)
    with hobbitpy.Llama(path, offload=config, n_ctx=64, verbose=False) as llm:
        types = {p["type"] for p in llm.pool_stats()}
    assert types and "Q8_0" not in types, types
    ref_scores = run_logits(path, hobbitpy.OffloadConfig(enabled=False))[0]
    # another precision: close to stock, not equal
    assert not np.array_equal(scores, ref_scores)
    assert np.corrcoef(scores.ravel(), ref_scores.ravel())[0, 1] > 0.95


def test_a_quant_made_of_another_file_at_that_name_is_made_again(model_dir, tmp_path):
    # a model retrained or replaced at the same path: the quant hobbitpy made of the old one
    # would price the new one with the old one's weights; a quant without hobbitpy's record of
    # its source (the user's own file) is reused as it is
    one = tiny_model(model_dir, "llama", n_embd=256)
    other = tiny_model(model_dir, "llama", n_embd=256, seed=7)
    model = tmp_path / "m.gguf"
    shutil.copy(one, model)
    quant, made = make_uniform_quant(model, "Q4_K_M", tmp_path / "quants", threads=2)
    first = quant.read_bytes()
    assert made and source_record_path(quant).is_file()
    assert make_uniform_quant(model, "Q4_K_M", tmp_path / "quants", threads=2) == (quant, False)
    shutil.copy(other, model)  # the same name and shape, other weights
    again, made = make_uniform_quant(model, "Q4_K_M", tmp_path / "quants", threads=2)
    assert again == quant and made and quant.read_bytes() != first
    # the user's own file at that name, no record: theirs, reused and not touched
    source_record_path(quant).unlink()
    theirs = quant.read_bytes()
    shutil.copy(one, model)
    assert make_uniform_quant(model, "Q4_K_M", tmp_path / "quants", threads=2) == (quant, False)
    assert quant.read_bytes() == theirs


def test_iq4_xs_is_a_uniform_quant_users_download(model_dir):
    # IQ4_XS (no importance matrix needed) is among the quants people pick for a 30B MoE
    path = tiny_model(model_dir, "llama", n_embd=256)
    quant, made = make_uniform_quant(path, "iq4_xs", model_dir / "quants", threads=2)
    assert made and quant.name.endswith(".IQ4_XS.gguf") and quant.stat().st_size < path.stat().st_size
    experts = {t.tensor_type.name for t in gguf.GGUFReader(quant).tensors if "_exps" in t.name}
    assert "IQ4_XS" in experts, experts
