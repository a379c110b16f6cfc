#!/usr/bin/env python3
"""What the default ladder (default_ladder.py) costs in quality, budget by budget: the model's
experts placed over its Q2_K copy by the routers' weight on the shipped calibration text, scored
against stock on a held-out text (hobbitpy eval's measure), beside the share of that weight left
at Q2_K: how the perplexity increase goes with the mean KL the default decides by (MAX_MEAN_KL).

    python scripts/price_default_ladder.py MODEL HELD_OUT.txt [TOKENS] [EXTRA,...]

EXTRA: budgets as the share of the bytes between the Q2_K copy and every expert at the
model's precision (default 0,0.1,0.25,0.4,0.6,0.8). Needs MODEL.experts-Q2_K.gguf and
MODEL.hobbit-importance.json next to the model (a capped `hobbitpy run` that chose the ladder
makes both; or `hobbitpy prepare MODEL --low Q2_K`)."""

import sys

import numpy as np

from hobbitpy import OffloadConfig, inspect_model
from hobbitpy.default_ladder import LOW_TYPE, calibration_text, load_calibration, low_weight_share
from hobbitpy.evaluate import evaluate_against, measure_reference, tokenize_text
from hobbitpy.placement import layer_expert_bytes, place_by_importance
from hobbitpy.prepare import default_companion_path

MB = 1024 * 1024


def main() -> int:
    model, text_path = sys.argv[1], sys.argv[2]
    n_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    extras = [float(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "0,0.1,0.25,0.4,0.6,0.8").split(",")]
    info = inspect_model(model)
    calibration = load_calibration(model, info, calibration_text())
    low_path = str(default_companion_path(model, LOW_TYPE))
    if calibration is None:
        sys.exit(f"{model}: no importance of the calibration text next to it (run it under a cap first)")
    importance = calibration.importance
    high_bytes, low_bytes = layer_expert_bytes(model, info.n_expert), layer_expert_bytes(low_path, info.n_expert)
    low_total = int(low_bytes.sum()) * info.n_expert
    with open(text_path, encoding="utf-8") as f:
        reference = measure_reference(model, tokenize_text(model, f.read(), n_tokens), n_ctx=256, n_threads=2)
    print(f"stock perplexity {reference.perplexity:.4f} on {len(reference.ids)} tokens")
    for extra in extras:
        budget = int(low_total + extra * (info.expert_bytes_total - low_total))
        placement = place_by_importance(importance, [high_bytes, low_bytes], budget)
        config = OffloadConfig(low=low_path, hits="found", importance=tuple(map(tuple, importance.tolist())),
                               cache_mb=budget / MB)
        r = evaluate_against(model, reference, config, n_ubatch=256, n_threads=2)
        n_high = int(np.sum(np.array(placement) == 0))
        print(f"budget {budget / MB:7.0f} MB  at the model's precision {n_high:5d} of {info.n_layer_moe * info.n_expert}"
              f"  weight at {LOW_TYPE} {100 * low_weight_share(importance, placement):5.1f} %  "
              f"ppl {100 * (r.perplexity / reference.perplexity - 1):+.2f} % (se {100 * (r.log_ppl_ratio_se or 0):.2f})"
              f"  KL {r.mean_kl:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
