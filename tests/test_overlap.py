"""The I/O thread runs under compute: prefetched experts arrive while the graph is
still computing, and prefetching changes no output bit."""

from __future__ import annotations

import numpy as np

import hobbitpy
from conftest import MB, run_logits, tiny_model


def test_prefetch_completes_while_compute_runs(model_dir):
    path = tiny_model(model_dir, "llama", n_layer=6)
    info = hobbitpy.inspect_model(path)
    budget_mb = info.expert_bytes_total / 2 / MB

    ref_scores, ref_text, _, _ = run_logits(path, hobbitpy.OffloadConfig(enabled=False))
    scores, text, _, _ = run_logits(path, hobbitpy.OffloadConfig(cache_mb=budget_mb, prefetch_layers=1))
    assert np.array_equal(scores.view(np.uint32), ref_scores.view(np.uint32))
    assert text == ref_text

    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=budget_mb, prefetch_layers=1),
                         n_ctx=256, verbose=False, n_threads=2)
    try:
        llm.create_completion("The old lighthouse keeper said", max_tokens=48, temperature=0.0)
        s = llm.offload_stats()
    finally:
        llm.close()
    assert s["prefetch_issued"] > 0
    # loads that finished while no layer waited and the graph was between two MoE
    # layers: the read overlapped the computation of the current layer
    assert s["loads_overlapped"] > 0, s
    assert s["prefetch_used"] > 0, s
    assert s["bytes_read"] == s["n_reads"] * info.expert_bytes
    assert s["peak_pool_bytes"] <= s["budget_bytes"]
