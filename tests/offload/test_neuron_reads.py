"""CORM's neuron-granular reads (`prepare --neuron-layout`, `--neurons THETA --neuron-layout FILE`):
the layout holds the model's experts with down transposed, a neuron per row, bundled with its
up row; the runtime reads each expert's gate projection, then only the neurons the activations
keep (their up and down rows in one read per run), and computes up and down over them. At θ = 0 every neuron is read and kept: the logits differ
from stock's only by the re-quantized down projection. Above it the rule is the stock pricing
path's with exact activations (`NeuronMaskSpec(predicted=False)`), and fewer bytes are read."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import hobbitpy
from hobbitpy.cli import main as cli_main
from hobbitpy.copies.prepare import prepare_companion
from conftest import EVAL_TEXT, MB, evaluate_text, fast_first, reference, run_logits, tiny_model



def _layout(model_dir, path):
    out = model_dir / (path.stem + ".neurons-Q8_0.gguf")
    if not out.exists():
        prepare_companion(path, "Q8_0", out, neuron_layout=True, progress=False)
    return out


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.slow
def test_the_layout_keeps_gate_and_up_and_bundles_down_transposed_with_up(model_dir):
    path = tiny_model(model_dir, "llama")
    layout = _layout(model_dir, path)
    model, neurons = _tensors(path), _tensors(layout)
    gate = "blk.0.ffn_gate_exps.weight"
    assert np.array_equal(np.asarray(model[gate].data), np.asarray(neurons[gate].data))  # Q8_0 blocks unchanged
    up, down = "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"
    assert down not in neurons
    n_ff, n_embd, n_expert = (int(n) for n in model[down].shape)
    assert [int(n) for n in neurons[up].shape] == [n_embd, 2 * n_ff, n_expert]
    bundle = np.asarray(neurons[up].data).reshape(n_expert, n_ff, 2, -1)  # [expert, neuron, up|down, row bytes]
    assert np.array_equal(bundle[:, :, 0].reshape(-1, bundle.shape[-1]),
                          np.asarray(model[up].data).reshape(-1, bundle.shape[-1]))  # up's blocks unchanged
    original = gguf.quants.dequantize(np.asarray(model[down].data), model[down].tensor_type)  # [expert, embd, ff]
    transposed = gguf.quants.dequantize(np.ascontiguousarray(bundle[:, :, 1]), neurons[up].tensor_type)  # [expert, ff, embd]
    step = np.abs(original).max() / 127
    assert np.abs(transposed.transpose(0, 2, 1) - original).max() <= step
    assert not np.array_equal(transposed.transpose(0, 2, 1), original)  # re-quantized per neuron: the layout's loss
    reader = gguf.GGUFReader(layout)
    field = reader.fields["hobbitpy.companion.neuron_layout"]
    assert bool(field.parts[field.data[0]][0])
    # every tensor starts on a page, so that each bundle starts on a disk's 512-byte granule
    assert reader.alignment == 4096 and gguf.GGUFReader(path).alignment == 32
    assert all(t.data_offset % 4096 == 0 for t in reader.tensors)


def _with_float_experts(path, out):
    """The model with its experts dequantized to F32: the same weights, multiplied without
    quantizing the activations (what stock's Q8_0 kernels do)."""
    from hobbitpy.files.gguf_fields import field_value

    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, bytes(field_value(reader.fields["general.architecture"])[0]).decode())
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            value, vtype, sub_type = field_value(field)
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        if "_exps." in t.name:
            writer.add_tensor(t.name, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch,budget", fast_first([("llama", "half"), ("gpt-oss", "half"), ("llama", "minimum")]))
def test_theta_zero_reads_every_neuron_and_computes_the_experts(model_dir, arch, budget):
    """Every neuron read and kept, down through the runtime's kernel: about as close to the
    experts' exact product (their F32 twin on stock) as stock's own Q8_0 kernels come, which
    quantize the activations (the layout's re-quantized down adds its own rounding). At the
    minimum budget the row cache holds one token's experts whole: the prompt runs in waves
    no larger than that."""
    path = tiny_model(model_dir, arch)
    layout = _layout(model_dir, path)
    ref_scores, _, _, info = reference(path)
    exact_scores = reference(_with_float_experts(path, model_dir / f"{path.stem}-f32-experts.gguf"))[0]
    cache = info.expert_bytes_total / 2 if budget == "half" else info.min_budget_bytes
    config = hobbitpy.OffloadConfig(cache_mb=cache / MB, neurons=0.0, neuron_layout=str(layout))
    scores, _, stats, _ = run_logits(path, config)
    assert stats["expert_misses"] > 0 and stats["neuron_reads"] > 0
    assert stats["neuron_selections"] > 0 and stats["neuron_whole"] == stats["neuron_selections"]
    assert np.abs(scores - exact_scores).max() <= 1.5 * np.abs(ref_scores - exact_scores).max()
    assert (scores.argmax(-1) == ref_scores.argmax(-1)).mean() >= 0.9


def test_neurons_read_cost_what_the_exact_pricing_says_and_read_fewer_bytes(model_dir):
    from hobbitpy.analysis.neurons import NeuronMaskSpec

    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    layout = _layout(model_dir, path)
    budget = hobbitpy.inspect_model(path).expert_bytes_total / 2 / MB
    theta = 0.05
    reads = evaluate_text(path, hobbitpy.OffloadConfig(cache_mb=budget, neurons=theta, neuron_limit=1.0, neuron_layout=str(layout)))
    priced = evaluate_text(path, hobbitpy.OffloadConfig(enabled=False), neurons=NeuronMaskSpec(theta, predicted=False, limit=1.0))
    whole = evaluate_text(path, hobbitpy.OffloadConfig(cache_mb=budget))
    assert reads.offloaded and reads.mean_kl > 0.0 and priced.mean_kl > 0.0
    # one rule (W1 first: the activations themselves), plus the layout's re-quantized down
    assert reads.mean_kl == pytest.approx(priced.mean_kl, rel=0.25)
    n = reads.stats["neuron_selections"]
    assert n == priced.stats["neuron_selections"]  # every MoE layer, the first too
    assert reads.stats["neuron_kept"] / n == pytest.approx(priced.stats["neuron_kept_share"], abs=0.02)
    assert reads.stats["neuron_reads"] > 0
    assert reads.stats["bytes_read"] < whole.stats["bytes_read"]
    # the budget counts rows, not whole experts: the same bytes hold the gates of more experts
    # (gates first, beside the rows of one token's experts whole) and never more than the budget
    assert reads.stats["n_slot"] >= 2 * whole.stats["n_slot"]
    assert whole.stats["pool_bytes"] <= reads.stats["pool_bytes"] <= budget * MB


@pytest.mark.slow
def test_bad_neuron_layouts_are_one_line_and_exit_2(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama")
    layout = _layout(model_dir, path)
    other = tiny_model(model_dir, "llama", seed=1)
    plain = tmp_path / "plain.gguf"
    prepare_companion(path, "Q8_0", plain, progress=False)
    text = tmp_path / "text.txt"
    text.write_text(EVAL_TEXT)
    half = f"{hobbitpy.inspect_model(path).expert_bytes_total / 2 / MB:.3f}"
    base = ["eval", str(path), "--text", str(text), "--ctx", "32", "--threads", "2", "--cache-mb", half]
    assert cli_main([*base, "--neurons", "0.05", "--neuron-layout", str(layout)]) == 0
    assert "neurons kept" in capsys.readouterr().out
    for bad in (["--neuron-layout", str(layout)],                                  # no threshold
                ["--neurons", "0.05", "--neuron-layout", str(tmp_path / "missing.gguf")],  # no such file
                ["--neurons", "0.05", "--neuron-layout", str(plain)],               # not a neuron layout
                ["--neurons", "0.05", "--neuron-layout", str(_layout(model_dir, other))],  # another model's
                ["--neurons", "0.05", "--neuron-layout", str(layout), "--low", "Q2_K"]):
        assert cli_main([*base, *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("neuron" in err[0] or "another model" in err[0]), err
    # prepare: one line, exit 2, nothing overwritten
    before = layout.read_bytes()
    assert cli_main(["prepare", str(path), "--neuron-layout", "--out", str(layout)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert layout.read_bytes() == before
    assert cli_main(["prepare", str(path), "--neuron-layout", "--mid", "Q4_K"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
