#!/usr/bin/env python3
"""What the default ladder (default_ladder.py) costs, budget by budget: the model's experts
placed over its Q2_K copy in the default's order (the routers' weight on the shipped calibration
text times what each expert loses at Q2_K: placement.expected_error) and, beside it, by the
routers' weight alone; each measured as the default measures them (mean KL from the model on
that text, the figure it decides by) and scored against stock on a held-out text (hobbitpy
eval's measure), with the share of the routers' weight left at Q2_K.

    python scripts/price_default_ladder.py MODEL HELD_OUT.txt [TOKENS] [SHARE,...]

SHARE: budgets as the share of the bytes between the Q2_K copy and every expert at the
model's precision (default 0,0.1,0.25,0.4,0.6,0.8). Makes MODEL.experts-Q2_K.gguf next to
the model when it is missing."""

import os
import sys

from hobbitpy import OffloadConfig, inspect_model
from hobbitpy.runtime.default_ladder import (LOW_TYPE, calibration_text, copy_rounding_error, ladder_placement,
                                             low_copy_layer_bytes, low_weight_share)
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.runtime.llama import compare_ladder, measure_calibration
from hobbitpy.files.model_file import layer_expert_bytes
from hobbitpy.copies.companions import default_companion_path
from hobbitpy.copies.prepare import prepare_companion
from hobbitpy.plan.placement import expected_error

MB = 1024 * 1024


def main() -> int:
    model, text_path = sys.argv[1], sys.argv[2]
    n_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    shares = [float(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "0,0.1,0.25,0.4,0.6,0.8").split(",")]
    info = inspect_model(model)
    low_path = str(default_companion_path(model, LOW_TYPE))
    if not os.path.exists(low_path):
        prepare_companion(model, LOW_TYPE, low_path, threads=os.cpu_count() or 1)
    low_total = int(low_copy_layer_bytes(info).sum()) * info.n_expert
    model_bytes = layer_expert_bytes(model)
    calibration = measure_calibration(model, calibration_text(), os.cpu_count() or 1)
    with open(text_path, encoding="utf-8") as f:
        held = measure_reference(model, tokenize_text(model, f.read(), n_tokens), n_ctx=256, n_threads=2)
    print(f"stock perplexity {held.perplexity:.4f} on {len(held.ids)} held-out tokens")
    error = copy_rounding_error(info, low_path, calibration.reference, os.cpu_count() or 1)
    orders = {"the default's": expected_error(calibration.importance, error), "routers' weight": calibration.importance}
    for share in shares:
        budget = int(low_total + share * (info.expert_bytes_total - low_total))
        for name, order in orders.items():
            placement, n_high = ladder_placement(info, model_bytes, budget, order)
            config = OffloadConfig(low=low_path, hits="found", importance=tuple(map(tuple, order.tolist())),
                                   cache_mb=budget / MB, auto=False)
            c = compare_ladder(model, calibration.reference, config, 2)
            r = evaluate_against(model, held, config, n_ubatch=256, n_threads=2)
            print(f"share {share:4.2f}  budget {budget / MB:7.0f} MB  {name:15s} at the model's precision {n_high:5d} "
                  f"of {info.n_layer_moe * info.n_expert}  weight at {LOW_TYPE} "
                  f"{100 * low_weight_share(calibration.importance, placement):5.1f} %  calibration KL {c.mean_kl:.4f} "
                  f"(ppl {100 * c.ppl_increase:+.2f} %)  held-out KL {r.mean_kl:.4f} "
                  f"ppl {100 * (r.perplexity / held.perplexity - 1):+.2f} % (se {100 * (r.log_ppl_ratio_se or 0):.2f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
