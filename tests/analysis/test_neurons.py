"""CORM's neuron statistics (`hobbitpy trace --neurons`): the router inputs the runtime
records are the ones the routers saw, and the shares follow from them and the model's own
gate weights."""

from __future__ import annotations

import os

import numpy as np
import pytest

import hobbitpy
from hobbitpy import HobbitError
from hobbitpy.cli import main as cli_main
from hobbitpy.analysis.neurons import GateWeights, neuron_stats, parse_thetas
from hobbitpy.measure.trace import record_trace
from hobbitpy.files.trace_file import load_trace

from conftest import tiny_model

PROMPTS = ["The old fisherman told stories about the sea", "In the beginning the village was quiet and small"]


def _router_weights(path, n_layer):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(os.fspath(path)).tensors}
    out = []
    for il in range(n_layer):
        t = tensors[f"blk.{il}.ffn_gate_inp.weight"]
        out.append(dequantize(t.data, t.tensor_type).astype(np.float32).reshape(int(t.shape[1]), int(t.shape[0])))
    return out


@pytest.fixture(scope="module")
def traced(model_dir):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    return path, record_trace(path, PROMPTS, n_predict=6, n_ctx=128, keep_inputs=True,
                              neuron_thetas=(0.0, 0.05, 0.2))


def test_the_recorded_inputs_are_what_each_router_saw(traced):
    path, t = traced
    n_embd = hobbitpy.inspect_model(path).n_embd
    assert t.inputs.shape == (t.n_tokens, 4, n_embd) and np.isfinite(t.inputs).all() and np.abs(t.inputs).sum() > 0
    for il, w in enumerate(_router_weights(path, 4)):
        logits = t.inputs[:, il] @ w.T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(probs, t.probs[:, il].astype(np.float32), atol=3e-3)


def test_the_shares_follow_from_the_inputs_and_the_gate_weights(traced):
    path, t = traced
    s = t.neurons
    n, L, k = t.experts.shape
    assert s.active.shape == s.predicted.shape == s.recall.shape == (n, L, k, 3)
    active = s.active.astype(np.float32)
    assert np.allclose(active[..., 0], 1.0)  # theta 0: every neuron not exactly zero
    assert (np.diff(active, axis=-1) <= 0).all() and active[..., 2].mean() < active[..., 1].mean()
    assert np.isnan(s.predicted[:, 0]).all() and np.isfinite(s.predicted[:, 1:]).all()  # nothing predicts layer 0

    # one selection by hand: token 5, layer 2, the second expert, theta 0.2
    by_layer = GateWeights(path, L)
    gates = [by_layer[l] for l in range(L)]
    e = t.experts[5, 2, 1]
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    act = np.abs(silu(gates[2][e] @ t.inputs[5, 2])) > 0.2
    guess = np.abs(silu(gates[2][e] @ t.inputs[5, 1])) > 0.2
    n_ff = gates[2].shape[1]
    assert s.active[5, 2, 1, 2] == np.float16(act.sum() / n_ff)
    assert s.predicted[5, 2, 1, 2] == np.float16(guess.sum() / n_ff)
    assert s.recall[5, 2, 1, 2] == np.float16((act & guess).sum() / act.sum())

    # a layer predicted from its own input is predicted perfectly
    same = np.repeat(t.inputs[:, 1:2], L, axis=1)
    own = neuron_stats(t, same, gates, (0.2,))
    np.testing.assert_array_equal(own.predicted[:, 1:], own.active[:, 1:])
    assert np.nanmin(own.recall[:, 1:].astype(np.float32)) == 1.0


def test_trace_neurons_on_the_command_line(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "t.npz"
    assert cli_main(["trace", str(path), "--prompts", str(prompts), "--out", str(out), "-n", "4", "--ctx", "128",
                     "--neurons", "0.1,0.25"]) == 0
    text = capsys.readouterr().out
    assert "neuron sparsity" in text and "recall" in text and "0.25" in text
    back = load_trace(out)
    assert back.neurons is not None and back.neurons.thetas.tolist() == pytest.approx([0.1, 0.25])
    assert back.neurons.active.shape == (back.n_tokens, 4, 2, 2)
    # without --neurons the trace has none
    plain = tmp_path / "plain.npz"
    assert cli_main(["trace", str(path), "--prompts", str(prompts), "--out", str(plain), "-n", "2", "--ctx", "128"]) == 0
    assert load_trace(plain).neurons is None


def test_bad_neuron_requests_are_one_clear_error(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS[0] + "\n")
    for bad in ("abc", "0.1,-1", "nan"):
        assert cli_main(["trace", str(path), "--prompts", str(prompts), "--out", str(tmp_path / "x.npz"),
                         "--neurons", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "thresholds" in err[0]
    assert not (tmp_path / "x.npz").exists()
    with pytest.raises(ValueError):
        parse_thetas("")
    oss = tiny_model(model_dir, "gpt-oss")
    with pytest.raises(HobbitError, match="SwiGLU"):
        record_trace(oss, PROMPTS, n_predict=2, n_ctx=128, neuron_thetas=(0.1,))
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert cli_main(["eval", str(oss), "--text", str(text), "--ctx", "32", "--no-offload", "--neurons", "0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SwiGLU" in err[0]


def test_plot_neurons_draws_a_new_png_or_says_what_is_missing(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    with_stats = record_trace(path, PROMPTS, n_predict=2, n_ctx=128, neuron_thetas=(0.1,)).save(tmp_path / "n.npz")
    plain = record_trace(path, PROMPTS, n_predict=2, n_ctx=128).save(tmp_path / "p.npz")
    png = tmp_path / "n.png"
    assert cli_main(["plot", str(with_stats), "--neurons", "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["plot", str(with_stats), "--neurons", "--out", str(png)]) == 2  # never overwrites
    capsys.readouterr()
    assert cli_main(["plot", str(plain), "--neurons", "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no neuron statistics" in err[0] and not (tmp_path / "p.png").exists()


TEXT = ("The keeper climbed the stairs of the tower every evening, lit the lamp and watched the sea. "
        "Ships passed in the dark, and the light turned slowly over the water until the morning came. ") * 3


@pytest.mark.parametrize("arch", ["llama", "qwen2moe"])
def test_neuron_pricing_at_theta_zero_is_stock_bit_for_bit(model_dir, arch):
    """Every neuron kept: CORM's sparse compute must equal stock exactly (KL 0, all top-1s)."""
    from hobbitpy import OffloadConfig
    from hobbitpy.measure.evaluate import evaluate
    from hobbitpy.analysis.neurons import NeuronMaskSpec

    path = tiny_model(model_dir, arch, n_layer=4, n_expert=8, n_expert_used=2)
    for predicted in (False, True):
        r = evaluate(path, TEXT, OffloadConfig(enabled=False), n_ctx=32, n_threads=2,
                     neurons=NeuronMaskSpec(0.0, predicted=predicted, limit=1.0))
        assert r.mean_kl == 0.0 and r.top1_agreement == 1.0 and r.perplexity == r.reference_perplexity
        assert r.stats["neuron_selections"] > 0 and r.stats["neuron_kept_share"] == pytest.approx(1.0)
        # the first MoE layer is never predicted: computed whole
        assert (r.stats["neuron_whole"] > 0) == predicted


def test_neuron_pricing_drops_neurons_and_costs_quality(model_dir):
    from hobbitpy import OffloadConfig
    from hobbitpy.measure.evaluate import evaluate
    from hobbitpy.analysis.neurons import NeuronMaskSpec

    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    oracle = evaluate(path, TEXT, OffloadConfig(enabled=False), n_ctx=32, n_threads=2,
                      neurons=NeuronMaskSpec(0.05, predicted=False, limit=1.0))
    assert 0.0 < oracle.stats["neuron_kept_share"] < 1.0 and oracle.stats["neuron_whole"] == 0
    assert oracle.mean_kl > 0.0
    # with a limit below every selection's share, each is computed whole: stock again
    whole = evaluate(path, TEXT, OffloadConfig(enabled=False), n_ctx=32, n_threads=2,
                     neurons=NeuronMaskSpec(0.05, predicted=False, limit=0.0))
    assert whole.mean_kl == 0.0 and whole.stats["neuron_whole"] == whole.stats["neuron_selections"]


def test_eval_neurons_on_the_command_line_and_its_bad_input(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    base = ["eval", str(path), "--text", str(text), "--ctx", "32", "--threads", "2"]
    assert cli_main([*base, "--no-offload", "--neurons", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "neurons kept" in out and "perplexity increase" in out
    for bad in (["--no-offload", "--neuron-oracle"],        # without --neurons
                ["--no-offload", "--neurons", "-1"],
                ["--no-offload", "--neurons", "0.1", "--neuron-limit", "2"]):
        assert cli_main([*base, *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("neuron" in err[0] or "offload" in err[0]), err


def test_the_neuron_cache_replay_reads_what_each_variant_needs(traced):
    from hobbitpy.analysis.neuron_sim import simulate_neurons

    path, t = traced
    n, L, k = t.experts.shape
    n_ff = t.meta["n_ff_expert"]
    neuron_bytes = t.meta["expert_bytes"] // (3 * n_ff)
    everything = 2 * t.meta["expert_bytes_total"] / (1024 * 1024)
    by = {r.variant: r for r in simulate_neurons(t, everything, 0.2, granule_bytes=0)}
    # a cache holding every expert: whole experts are read once each
    distinct = len({(l, e) for l in range(L) for e in t.experts[:, l].ravel() if e >= 0})
    assert by["expert"].bytes_per_token * n == distinct * 3 * n_ff * neuron_bytes
    assert by["expert"].ratio_to_expert == 1.0 and by["expert"].whole == by["expert"].accesses
    # fewer neurons, fewer bytes; W1-first reads all of W1, so more than the oracle
    assert by["oracle"].bytes_per_token < by["w1-first"].bytes_per_token < by["expert"].bytes_per_token
    assert by["corm"].bytes_per_token < by["expert"].bytes_per_token
    # theta 0: every neuron is active, over the limit: each variant reads whole experts
    assert {r.variant: r.ratio_to_expert for r in simulate_neurons(t, everything, 0.0, granule_bytes=0)} == {
        "expert": 1.0, "corm": 1.0, "oracle": 1.0, "w1-first": 1.0}
    # read a page at a time, a neuron brings the other neurons of its page: rows this narrow put
    # an active neuron on nearly every page, so sparse reads take the whole expert
    paged = {r.variant: r for r in simulate_neurons(t, everything, 0.2)}
    assert t.meta["expert_bytes"] // (3 * n_ff) < 4096 // 2  # several neurons a page
    assert paged["oracle"].bytes_per_token > by["oracle"].bytes_per_token
    assert paged["oracle"].bytes_per_token <= paged["expert"].bytes_per_token
    # a small budget reads more, the same way round
    small = 3 * k * t.meta["expert_bytes"] / (1024 * 1024)
    tight = {r.variant: r for r in simulate_neurons(t, small, 0.2, granule_bytes=0)}
    assert tight["expert"].bytes_per_token > by["expert"].bytes_per_token
    assert tight["oracle"].bytes_per_token < tight["expert"].bytes_per_token


def test_simulate_neurons_on_the_command_line(traced, tmp_path, capsys):
    path, t = traced
    saved = t.save(tmp_path / "n.npz")
    budget = f"{2 * t.meta['expert_bytes_total'] / (1024 * 1024):.4f}"
    assert cli_main(["simulate", str(saved), "--budget-mb", budget, "--neurons", "0.2", "--read-granule", "0"]) == 0
    out = capsys.readouterr().out
    assert all(v in out for v in ("expert", "corm", "oracle", "w1-first")) and "x expert" in out
    assert cli_main(["simulate", str(saved), "--budget-mb", budget, "--neurons", "0.3"]) == 2  # not recorded
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "thresholds" in err[0]
    plain = record_trace(path, PROMPTS[:1], n_predict=2, n_ctx=128).save(tmp_path / "p.npz")
    assert cli_main(["simulate", str(plain), "--budget-mb", budget, "--neurons", "0.2"]) == 2
    assert "no neuron sets" in capsys.readouterr().err


def test_a_neuron_costs_the_granule_it_lies_on():
    from hobbitpy.analysis.neuron_sim import widen_to_granules

    bits = np.packbits(np.eye(10, dtype=np.uint8)[[5, 9]], axis=-1, bitorder="little")  # neuron 5; neuron 9
    wide = np.unpackbits(widen_to_granules(bits, 10, 4), axis=-1, count=10, bitorder="little")
    assert wide[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert wide[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]  # the last granule is short
    assert widen_to_granules(bits, 10, 1) is bits
