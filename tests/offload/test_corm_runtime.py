"""CORM's neuron sparsity in the runtime (`--neurons THETA`, `--preset corm`): at θ = 0 every
neuron is kept and the logits equal stock's bit for bit at any cache size, for every
architecture; above it neurons are left out as CORM predicts them, the same rule the stock
pricing path (`eval --no-offload --neurons`) applies with a graph callback."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from hobbitpy.cli import main as cli_main
from conftest import ARCHES, BUDGETS, EVAL_TEXT, MB, evaluate_text, fast_first, reference, run_logits, tiny_model



@pytest.mark.parametrize("budget", ["min", "half", "all"])
@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_theta_zero_keeps_every_neuron_bit_for_bit(model_dir, arch, budget):
    path = tiny_model(model_dir, arch)
    ref_scores, ref_text, _, info = reference(path)
    config = hobbitpy.OffloadConfig(cache_mb=BUDGETS[budget](info) / MB, neurons=0.0, neuron_limit=1.0,
                                    prefetch_layers=1)
    scores, text, stats, _ = run_logits(path, config)
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text
    assert stats["expert_misses"] > 0
    # every neuron of every predicted selection kept, and counted so
    assert stats["neuron_selections"] > 0
    assert stats["neuron_kept"] == stats["neuron_whole"] == stats["neuron_selections"]


def test_neurons_left_out_cost_what_the_stock_pricing_says(model_dir):
    """The runtime's mask and the pricing callback apply one rule (the callback dots in float32,
    the graph on ggml's quantized activations, so a neuron within rounding of θ may differ): both
    lose quality, by about as much, and a limit of 0 keeps every expert that keeps any neuron."""
    from hobbitpy.analysis.neurons import NeuronMaskSpec

    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    budget = info.expert_bytes_total / 2 / MB
    runtime = evaluate_text(path, hobbitpy.OffloadConfig(cache_mb=budget, neurons=0.05, neuron_limit=1.0))
    priced = evaluate_text(path, hobbitpy.OffloadConfig(enabled=False),
                   neurons=NeuronMaskSpec(0.05, predicted=True, limit=1.0))
    assert runtime.offloaded and runtime.mean_kl > 0.0 and priced.mean_kl > 0.0
    assert runtime.mean_kl == pytest.approx(priced.mean_kl, rel=0.25)
    assert abs(runtime.perplexity - priced.perplexity) < 0.1 * abs(priced.perplexity - priced.reference_perplexity) + 1e-3
    # the share kept, as the runtime counts it (MoE layers after the first), is the pricing's
    # (which counts the first MoE layer's selections as whole) without them
    n = runtime.stats["neuron_selections"]
    n_moe = 4
    assert n == priced.stats["neuron_selections"] * (n_moe - 1) // n_moe
    priced_share = (priced.stats["neuron_kept_share"] * n_moe - 1) / (n_moe - 1)
    assert runtime.stats["neuron_kept"] / n == pytest.approx(priced_share, abs=0.02)
    # more of the neurons left out: more lost
    wider = evaluate_text(path, hobbitpy.OffloadConfig(cache_mb=budget, neurons=0.2, neuron_limit=1.0))
    assert wider.mean_kl > runtime.mean_kl


def test_the_corm_preset_and_its_flags_on_the_command_line(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    text = tmp_path / "text.txt"
    text.write_text(EVAL_TEXT)
    half = hobbitpy.inspect_model(path).expert_bytes_total / 2 / MB  # a model that fits runs stock
    base = ["eval", str(path), "--text", str(text), "--ctx", "32", "--threads", "2", "--cache-mb", f"{half:.3f}"]
    assert cli_main([*base, "--preset", "corm"]) == 0
    out = capsys.readouterr().out
    assert "offload on" in out and "perplexity increase" in out and "mean KL to reference  0.000000" not in out
    assert cli_main([*base, "--neurons", "0", "--neuron-limit", "1"]) == 0
    assert "mean KL to reference  0.000000" in capsys.readouterr().out
    for bad in (["--neurons", "-1"], ["--neurons", "nan"], ["--neurons", "0.1", "--neuron-limit", "2"],
                ["--neuron-oracle"], ["--neurons", "0.1", "--neuron-oracle"]):
        assert cli_main([*base, *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "neuron" in err[0], err


@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_a_generation_whose_last_layer_computes_only_the_output_row(model_dir, arch):
    """A prompt's last layer computes only the rows that have outputs: the prediction takes the
    same rows of the previous MoE layer's input. θ = 0 prints stock's greedy text; θ > 0 runs."""
    import subprocess
    import sys

    path = tiny_model(model_dir, arch)
    half = f"{hobbitpy.inspect_model(path).expert_bytes_total / 2 / MB:.4f}"
    common = ["-m", "hobbitpy", "run", str(path), "--prompt", "The harbour at dawn was quiet", "-n", "12",
              "--temp", "0", "--threads", "2"]

    def run(*args):
        p = subprocess.run([sys.executable, *common, *args], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    stock = run("--no-offload")
    assert run("--cache-mb", half, "--neurons", "0", "--neuron-limit", "1") == stock
    assert run("--cache-mb", half, "--preset", "corm").strip()
