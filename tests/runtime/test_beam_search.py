"""Beam search (Fiddler's beam case): the beams are sequences of one context, each step one
batch of every beam's next token. The same code runs stock llama.cpp and hobbitpy, so with one
precision both find the same beams with the same scores, bit for bit, whatever the cache holds."""

from __future__ import annotations

import numpy as np
import pytest

import hobbitpy
from hobbitpy.cli import main as cli_main
from hobbitpy.settings.config import OffloadConfig
from hobbitpy.plan.placement import expert_popularity
from hobbitpy.settings.presets import preset_settings
from hobbitpy.measure.trace import record_trace

from conftest import ARCHES, MB, PROMPT, fast_first, tiny_model


def _search(path, offload: OffloadConfig, width: int, n_predict: int = 10):
    with hobbitpy.Llama(path, offload=offload, n_ctx=256, n_seq_max=width, n_threads=2, verbose=False) as llm:
        prompt = llm.tokenize(PROMPT.encode())
        result = llm.beam_search(prompt, width, n_predict)
        # the context is left empty: a plain decode after it is the same as on a fresh one
        llm.reset()
        llm.eval(prompt)
        after = llm.last_logits()
        return result, after, llm.offload_stats()


@pytest.mark.parametrize("arch", fast_first(ARCHES))
def test_beam_search_with_offload_is_stocks(model_dir, arch):
    path = tiny_model(model_dir, arch, n_layer=4)
    info = hobbitpy.inspect_model(path)
    stock, stock_after, _ = _search(path, OffloadConfig(enabled=False), 4)
    assert stock.steps == 9 and len(stock.beams) == 4
    assert [b.logprob for b in stock.beams] == sorted((b.logprob for b in stock.beams), reverse=True)
    assert len({tuple(b.tokens) for b in stock.beams}) == 4  # four different continuations
    popularity = expert_popularity(record_trace(path, ["The river ran past the mill"], n_predict=4, n_ctx=64,
                                                lookahead=0)).tolist()
    for config in (OffloadConfig(cache_mb=info.expert_bytes_total / 3 / MB, mode="gpu-centric"),
                   OffloadConfig(**{**preset_settings("fiddler"), "cache_mb": info.expert_bytes_total / 3 / MB,
                                    "popularity": popularity})):
        got, after, stats = _search(path, config, 4)
        assert [(b.tokens, b.logprob) for b in got.beams] == [(b.tokens, b.logprob) for b in stock.beams]
        assert np.array_equal(after.view(np.uint32), stock_after.view(np.uint32))
        assert stats["expert_misses"] + stats["expert_inplace"] > 0  # the cache was in play


def test_a_beam_search_of_one_is_greedy(model_dir):
    path = tiny_model(model_dir, "llama", n_layer=4)
    result, _, _ = _search(path, OffloadConfig(enabled=False), 1, n_predict=8)
    with hobbitpy.Llama(path, offload=False, n_ctx=256, n_threads=2, verbose=False) as llm:
        tokens = llm.tokenize(PROMPT.encode())
        greedy = []
        for _ in range(8):
            llm.eval(tokens[-1:] if greedy else tokens)
            greedy.append(int(np.argmax(llm.last_logits())))
            tokens.append(greedy[-1])
    assert result.tokens == greedy


def test_beam_search_needs_its_sequences_and_a_sane_width(model_dir, tmp_path, capsys):
    path = tiny_model(model_dir, "llama", n_layer=4)
    with hobbitpy.Llama(path, offload=False, n_ctx=64, verbose=False) as llm:
        prompt = llm.tokenize(PROMPT.encode())
        with pytest.raises(hobbitpy.HobbitError, match="n_seq_max=4"):
            llm.beam_search(prompt, 4, 4)
        with pytest.raises(ValueError, match="beam width"):
            llm.beam_search(prompt, 9, 4)
    with pytest.raises(ValueError, match="n_seq_max"):
        hobbitpy.Llama(path, n_seq_max=0, verbose=False)
    with hobbitpy.Llama(path, offload=False, n_ctx=64, n_seq_max=4, verbose=False) as llm:
        with pytest.raises(hobbitpy.HobbitError, match="do not fit the context"):
            llm.beam_search(llm.tokenize(PROMPT.encode()), 4, llm.n_ctx())
    with pytest.raises(SystemExit) as exit_:  # argparse's one-line usage error
        cli_main(["bench", str(path), "--beams", "9", "--out", str(tmp_path / "b")])
    assert exit_.value.code == 2
    assert "beam width of 1..8" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_substitution_serves_the_beams_and_reads_less(model_dir):
    """importance-driven substitution in a beam step (a decode batch): a low-score miss is
    served by a cached expert or one another beam reads anyway (Algorithm 2's batch rule), so
    the search loads fewer experts; lossy, so its beams may differ from stock's."""
    path = tiny_model(model_dir, "llama", n_layer=4)
    info = hobbitpy.inspect_model(path)
    base = OffloadConfig(cache_mb=info.expert_bytes_total / 3 / MB, mode="gpu-centric")
    _, _, off = _search(path, base, 4)
    got, _, on = _search(path, OffloadConfig(**{**base.__dict__, "substitute_alpha": 0.3}), 4)
    assert off["n_substituted"] == 0 and on["n_substituted"] > 0
    assert on["expert_misses"] < off["expert_misses"]
    assert len(got.beams) == 4 and all(np.isfinite(b.logprob) for b in got.beams)
