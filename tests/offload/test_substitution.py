"""Importance-driven substitution (Algorithm 1 of "Enabling MoE on the Edge via
Importance-Driven Expert Scheduling"): off, the runtime is stock's bit for bit; on, a
low-score selection that misses is served by a cached expert of similar score instead,
which raises the hit ratio at a price `eval` measures token by token (perplexity, KL,
top-1 against stock)."""

from __future__ import annotations

import dataclasses
import math

import pytest

import hobbitpy
from hobbitpy.settings.config import OffloadConfig
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.settings.presets import preset_settings

from conftest import ARCHES, MB, PROMPT, tiny_model

TEXT = (PROMPT + " told stories about the storms he had seen, the boats that never came home and the fish that "
        "got away, and the children of the village listened to him every evening until the lamps were lit. ") * 4


def _hit_ratio(stats: dict) -> float:
    return stats["expert_hits"] / max(1, stats["expert_hits"] + stats["expert_misses"])


@pytest.mark.parametrize("arch", ARCHES)
def test_substitution_serves_misses_from_the_cache_at_a_measured_price(model_dir, arch):
    path = tiny_model(model_dir, arch, n_layer=4)
    info = hobbitpy.inspect_model(path)
    reference = measure_reference(path, tokenize_text(path, TEXT, 128), n_ctx=64, n_threads=2)
    # a third of the experts cached, loaded on demand: many misses for substitution to serve
    base = OffloadConfig(cache_mb=info.expert_bytes_total / 3 / MB, mode="gpu-centric")
    # token by token, as decoding meets it (one-row matmuls: not the batch reference's bits,
    # so stock is scored the same way for the exact comparison)
    stock = evaluate_against(path, reference, OffloadConfig(enabled=False), n_ubatch=1, n_threads=2)
    off = evaluate_against(path, reference, base, n_ubatch=1, n_threads=2)
    on = evaluate_against(path, reference, dataclasses.replace(base, substitute_alpha=0.3), n_ubatch=1, n_threads=2)
    # off: stock's logits, nothing substituted
    assert off.stats["n_substituted"] == 0
    assert (off.perplexity, off.mean_kl, off.top1_agreement) == (stock.perplexity, stock.mean_kl, stock.top1_agreement)
    # on: selections replaced by cached experts, so fewer of them miss
    assert on.stats["n_substituted"] > 0
    assert _hit_ratio(on.stats) > _hit_ratio(off.stats)
    assert on.stats["expert_misses"] < off.stats["expert_misses"]
    # lossy, and priced: the outputs moved (by a finite, measured amount)
    assert on.perplexity != stock.perplexity and math.isfinite(on.perplexity) and math.isfinite(on.mean_kl)
    assert 0.0 < on.top1_agreement <= 1.0


def test_substitution_alpha_is_checked_and_the_importance_preset_sets_it():
    with pytest.raises(ValueError, match="substitute_alpha"):
        OffloadConfig(substitute_alpha=1.5)
    with pytest.raises(ValueError, match="substitute_alpha"):
        OffloadConfig(substitute_alpha=float("nan"))
    importance = OffloadConfig(**preset_settings("importance"))
    assert importance.substitute_alpha == 0.3 and importance.policy == "score"
