#!/usr/bin/env python3
"""How sensitive a model is to quantization: its uniform quants (made by llama.cpp's own
quantizer) scored against the model's own file on a text, as llama.cpp's perplexity and KL
tables score them (perplexity change, mean KL divergence per token, top-1 agreement).

    python scripts/quant_sensitivity.py MODEL.gguf held-out.txt [--tokens 4096] [--quants Q4_K_M,IQ4_XS,Q3_K_M,Q2_K]

The quants are made next to the model (MODEL.quants/, as bench keeps them) unless --folder
says elsewhere; a quant already there is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from hobbitpy.settings.config import OffloadConfig
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.copies.quants import default_quant_dir, make_uniform_quant, quant_name
from hobbitpy.files.tokens import tokenize_text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("text", help="UTF-8 text the model was not trained on")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored (default %(default)s)")
    ap.add_argument("--quants", default="Q4_K_M,IQ4_XS,Q3_K_M,Q2_K")
    ap.add_argument("--folder", help="where the quants are made (default: MODEL.quants next to the model)")
    ap.add_argument("--ctx", type=int, default=256, help="scoring window (default %(default)s)")
    ap.add_argument("--json", help="write the table here too")
    a = ap.parse_args()
    quants = [quant_name(q) for q in a.quants.split(",") if q.strip()]
    folder = a.folder or default_quant_dir(a.model)
    text = pathlib.Path(a.text).read_text(encoding="utf-8")
    ids = tokenize_text(a.model, text, a.tokens)
    threads = os.cpu_count() or 1
    ref = measure_reference(a.model, ids, n_ctx=a.ctx, n_threads=threads)
    print(f"{os.path.basename(a.model)}: perplexity {ref.perplexity:.3f} on {len(ids)} tokens of {a.text}")
    print(f"{'quant':8} {'MB':>8} {'ppl':>9} {'mean KL':>8} {'top-1':>7}")
    rows = {}
    for q in quants:
        path, _ = make_uniform_quant(a.model, q, folder, threads=threads)
        r = evaluate_against(path, ref, OffloadConfig(enabled=False), n_threads=threads)
        rows[q] = dict(bytes=os.path.getsize(path), ppl_increase=r.perplexity / ref.perplexity - 1, mean_kl=r.mean_kl,
                       top1_agreement=r.top1_agreement)
        print(f"{q:8} {rows[q]['bytes'] / 1e6:8.1f} {100 * rows[q]['ppl_increase']:+8.2f}% {r.mean_kl:8.4f} "
              f"{100 * r.top1_agreement:6.1f}%", flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"model": os.path.basename(a.model), "tokens": len(ids),
                                                    "perplexity": ref.perplexity, "quants": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
