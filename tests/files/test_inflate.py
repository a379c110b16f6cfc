"""hobbitpy inflate: experts become as large as real ones, the logits do not move a bit."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import llama_cpp
import numpy as np
import pytest

import hobbitpy
from conftest import MB, fast_first, run_logits, tiny_model
from hobbitpy.files.inflate import inflate

CASES = {
    "llama-q8_0": ("llama", {}, 512),
    "qwen2moe-q8_0": ("qwen2moe", {}, 768),
    "gpt-oss-q8_0": ("gpt-oss", {}, 512),  # expert biases grow too
    "llama-q4_k": ("llama", dict(expert_type="Q4_K", n_embd=256, n_ff=512), 1024),
}


def same_bits(a, b) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("case", fast_first(list(CASES), keep=2))
def test_inflated_logits_are_identical(model_dir, tmp_path, case):
    arch, kw, n_ff = CASES[case]
    src = tiny_model(model_dir, arch, **kw)
    dst = tmp_path / "wide.gguf"
    inflate(src, dst, n_ff, progress=False)
    before, after = hobbitpy.inspect_model(src), hobbitpy.inspect_model(dst)
    assert after.expert_bytes > before.expert_bytes
    a = run_logits(src, hobbitpy.OffloadConfig(enabled=False))
    b = run_logits(dst, hobbitpy.OffloadConfig(enabled=False))
    assert same_bits(a[0], b[0]) and a[1] == b[1]


@pytest.mark.slow
def test_q2_k_from_llama_cpp_quantizer(model_dir, tmp_path):
    # Q2_K experts (and the Q3_K down projections llama.cpp's Q2_K mix picks), made by
    # llama.cpp's own quantizer
    src = tiny_model(model_dir, "llama", expert_type="F16", n_embd=256, n_ff=512)
    q2k = tmp_path / "q2k.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(q2k).encode(), ctypes.byref(params)) == 0
    dst = tmp_path / "q2k-wide.gguf"
    inflate(q2k, dst, 1024, progress=False)
    a = run_logits(q2k, hobbitpy.OffloadConfig(enabled=False))
    b = run_logits(dst, hobbitpy.OffloadConfig(enabled=False))
    assert same_bits(a[0], b[0])
    # and the inflated model offloads exactly too
    info = hobbitpy.inspect_model(dst)
    c = run_logits(dst, hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB))
    assert same_bits(b[0], c[0])


@pytest.mark.slow
def test_cli_and_bad_input(model_dir, tmp_path):
    src = tiny_model(model_dir, "llama")
    out = tmp_path / "wide.gguf"
    cli = [sys.executable, "-m", "hobbitpy", "inflate"]
    proc = subprocess.run(cli + [str(src), str(out), "--n-ff", "512"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.exists()

    # an existing output is never overwritten
    before = out.read_bytes()
    proc = subprocess.run(cli + [str(src), str(out), "--n-ff", "768"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert out.read_bytes() == before

    with pytest.raises(ValueError, match="must exceed"):
        inflate(src, tmp_path / "narrow.gguf", 128, progress=False)
    with pytest.raises(hobbitpy.ModelFileError, match="dense model"):
        inflate(tiny_model(model_dir, "llama", n_expert=0), tmp_path / "d.gguf", 512, progress=False)
    with pytest.raises(hobbitpy.ModelFileError, match="cannot be widened"):
        inflate(src, tmp_path / "odd.gguf", 300, progress=False)  # not whole Q8_0 blocks
    assert not (tmp_path / "narrow.gguf").exists() and not (tmp_path / "odd.gguf").exists()


@pytest.mark.parametrize("arch", fast_first(["llama", "gpt-oss"]))
def test_a_padded_hidden_size_keeps_the_logits_bit_for_bit(model_dir, tmp_path, arch):
    from hobbitpy.files.inflate import pad_embedding

    src = tiny_model(model_dir, arch)
    dst = tmp_path / "tall.gguf"
    before = hobbitpy.inspect_model(src)
    pad_embedding(src, dst, 4 * before.n_embd, progress=False)
    after = hobbitpy.inspect_model(dst)
    assert after.n_embd == 4 * before.n_embd and after.n_embd_head_k == before.n_embd_head_k
    assert after.expert_bytes > 3 * before.expert_bytes  # gate/up rows four times as long, down four times the rows
    a = run_logits(src, hobbitpy.OffloadConfig(enabled=False))
    b = run_logits(dst, hobbitpy.OffloadConfig(enabled=False))
    assert same_bits(a[0], b[0]) and a[1] == b[1]
    # and offloaded
    c = run_logits(dst, hobbitpy.OffloadConfig(cache_mb=after.expert_bytes_total / 2 / MB))
    assert same_bits(b[0], c[0])


@pytest.mark.slow
def test_a_padded_hidden_size_must_be_a_power_of_four_times(model_dir, tmp_path):
    from hobbitpy.files.inflate import pad_embedding

    src = tiny_model(model_dir, "llama")
    n = hobbitpy.inspect_model(src).n_embd
    for bad in (2 * n, 3 * n, n, n + 32):
        with pytest.raises(ValueError, match="power of 4"):
            pad_embedding(src, tmp_path / f"x{bad}.gguf", bad, progress=False)
    assert not list(tmp_path.iterdir())
    with pytest.raises(hobbitpy.HobbitError, match="hidden size"):  # qwen2moe's attention is sized by it
        pad_embedding(tiny_model(model_dir, "qwen2moe"), tmp_path / "q.gguf", 4 * n, progress=False)
    assert not list(tmp_path.iterdir())
