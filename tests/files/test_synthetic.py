"""The synthetic model generator: deterministic, the shapes asked for, every arch loads."""

from __future__ import annotations

import gguf
import pytest

import hobbitpy
from conftest import fast_first
from hobbitpy.files.synthetic_moe import make_synthetic_moe


@pytest.mark.slow
def test_deterministic_and_shaped(tmp_path):
    a = make_synthetic_moe(tmp_path / "a.gguf", "llama", n_layer=3, n_expert=6, n_expert_used=3, n_embd=64, n_ff=96, seed=7)
    b = make_synthetic_moe(tmp_path / "b.gguf", "llama", n_layer=3, n_expert=6, n_expert_used=3, n_embd=64, n_ff=96, seed=7)
    c = make_synthetic_moe(tmp_path / "c.gguf", "llama", n_layer=3, n_expert=6, n_expert_used=3, n_embd=64, n_ff=96, seed=8)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    info = hobbitpy.inspect_model(a)
    assert (info.n_layer, info.n_layer_moe, info.n_expert, info.n_expert_used, info.n_embd) == (3, 3, 6, 3, 64)
    up = next(t for t in gguf.GGUFReader(a).tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert [int(x) for x in up.shape] == [64, 96, 6]


@pytest.mark.parametrize("arch", fast_first(["llama", "qwen2moe", "gpt-oss"]))
def test_each_arch_generates_text(tmp_path, arch):
    path = make_synthetic_moe(tmp_path / f"{arch}.gguf", arch)
    with hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(enabled=False), n_ctx=64, verbose=False) as llm:
        out = llm.create_completion("Once", max_tokens=6, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 6
