"""Every MoE architecture the synthetic writer makes (hobbitpy.files.synthetic_moe.ARCH_LAYOUTS:
each as llama.cpp's loader reads it, with its own routing: sigmoid scores, a selection bias,
expert groups, leading dense layers, interleaved MoE layers, shared experts, latent
attention) runs offloaded bit-exact to stock, at a tight budget and at 60 % of its experts.
docs/MODELS.md is the table of what these tests cover."""

from __future__ import annotations

import pathlib

import pytest

import hobbitpy
from conftest import ARCHES, MB, assert_bit_equal, copy_gguf, hobbitpy_cli, prompt_logits, tiny_model
from hobbitpy.files.model_file import OFFLOAD_REFUSED
from hobbitpy.files.supported_models import models_table
from hobbitpy.files.synthetic_moe import ARCH_LAYOUTS, EXPERT_TYPES

REPO = pathlib.Path(__file__).resolve().parents[2]
# the architectures the feature tests do not run (those run them all, exactness included)
# (qwen3next's recurrent layers make it the slowest: the README's run leaves it to the slow one)
OTHER_ARCHES = [pytest.param(a, marks=pytest.mark.slow) if a == "qwen3next" else a for a in ARCH_LAYOUTS if a not in ARCHES]


@pytest.mark.parametrize("arch", OTHER_ARCHES)
def test_each_architecture_is_exact_at_a_tight_budget_and_at_60_percent(model_dir, arch):
    path = tiny_model(model_dir, arch)
    info = hobbitpy.inspect_model(path)
    layout = ARCH_LAYOUTS[arch]
    n_dense = sum(1 for i in range(info.n_layer) if i < layout.dense_lead or
                  (layout.moe_every > 1 and (i + 1) % layout.moe_every))
    assert info.n_layer_moe == info.n_layer - n_dense  # dense layers and shared experts are not routed experts
    ref_scores, ref_stats = prompt_logits(path, hobbitpy.OffloadConfig(enabled=False))
    assert not ref_stats["offloaded"]
    for budget in (info.min_budget_bytes + info.expert_bytes, int(0.6 * info.expert_bytes_total)):
        scores, stats = prompt_logits(path, hobbitpy.OffloadConfig(cache_mb=budget / MB, mode="gpu-centric"))
        assert_bit_equal(scores, ref_scores)
        assert stats["expert_misses"] > 0 and stats["pool_bytes"] <= budget
        assert stats["bytes_read"] == stats["n_reads"] * info.expert_bytes


def test_the_models_page_is_the_table_of_what_the_tests_run():
    """docs/MODELS.md is rendered from the architectures and expert types the tests are
    parametrized with (`python -m hobbitpy.files.supported_models` writes it)."""
    assert {a if isinstance(a, str) else a.values[0] for a in OTHER_ARCHES} | set(ARCHES) == set(ARCH_LAYOUTS)
    page = (REPO / "docs" / "MODELS.md").read_text()
    assert page.endswith(models_table()), "docs/MODELS.md is stale: python -m hobbitpy.files.supported_models"
    for name in list(ARCH_LAYOUTS) + list(EXPERT_TYPES):
        assert f"`{name}`" in page


@pytest.mark.parametrize("arch", list(OFFLOAD_REFUSED))
def test_an_architecture_the_cache_cannot_serve_is_refused_in_one_line(model_dir, tmp_path, arch):
    """Before llama.cpp loads anything (a file under that architecture's name is enough): one
    line naming the file, the architecture and why, exit 2."""
    path = copy_gguf(tiny_model(model_dir, "llama"), tmp_path / f"{arch}.gguf", arch=arch)
    proc = hobbitpy_cli("run", path, "--prompt", "Hi", "-n", "1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"hobbitpy: error: {path}: a {arch} model: ")
    assert "--no-offload" in proc.stderr and "Traceback" not in proc.stderr

