#!/usr/bin/env python3
"""What each configuration a searching default could serve costs, budget by budget, on a text the
model did not train on: the model's own experts (exact), the importance ladder over each low copy
(the model's experts the routers weigh most at its precision, the rest from the copy, as the
default's ladder places them), and HOBBIT's dynamic precision over the Q2_K copy (per token, the
selections whose eq.-2 score is above T1 from the copy, nothing skipped): with hits exact (every
such selection from the copy, the default's price of it) and as the default serves it (hits
at-least: a cached copy at the model's precision serves them too; a small low pool). Each is
scored as decoding meets it (ubatch 1) against the model's own file: mean KL, perplexity change,
and the megabytes read from disk a token (the cache's own count: the same on any machine).

    python scripts/price_default_search.py MODEL HELD_OUT.txt [--tokens 2048] [--shares 0.6,0.75,0.9]
                                           [--lows Q2_K,Q3_K] [--t1 0.6]

Budgets are shares of the model's expert bytes. The low copies are made next to the model
(MODEL.experts-TYPE.gguf) when missing; a low type written TYPE+imatrix is quantized with an
importance matrix of hobbitpy's calibration text (collected once, MODEL.imatrix.gguf; the copy
MODEL.experts-TYPE-imatrix.gguf). Dynamic precision is priced over the first low copy, at each T1."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

from hobbitpy import OffloadConfig, inspect_model
from hobbitpy.copies.companions import default_companion_path
from hobbitpy.copies.imatrix import collect_imatrix, default_imatrix_path
from hobbitpy.copies.prepare import prepare_companion
from hobbitpy.files.tokens import tokenize_text
from hobbitpy.measure.evaluate import evaluate_against, measure_reference
from hobbitpy.runtime.default_ladder import DYNAMIC, calibration_text
from hobbitpy.runtime.llama import measure_calibration
from hobbitpy.settings.config import MAX_MEAN_KL

MB = 1024 * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("text", help="UTF-8 text the model was not trained on")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shares", default="0.6,0.75,0.9", help="budgets, as shares of the model's expert bytes")
    ap.add_argument("--lows", default="Q2_K,Q3_K", help="the low copies' types (TYPE+imatrix: with an importance "
                    "matrix of the calibration text)")
    ap.add_argument("--t1", default="0.6", help="dynamic precision's T1 values")
    a = ap.parse_args()
    threads = os.cpu_count() or 1
    info = inspect_model(a.model)
    lows = {}
    for low in a.lows.split(","):
        low_type, _, weighed = low.partition("+")
        imatrix = None
        if weighed:
            imatrix = default_imatrix_path(a.model)
            if not imatrix.exists():
                with tempfile.TemporaryDirectory() as folder:
                    text = pathlib.Path(folder) / "calibration.txt"
                    text.write_text(calibration_text(), encoding="utf-8")
                    collect_imatrix(a.model, text, imatrix, n_threads=threads)
        path = default_companion_path(a.model, low_type)
        path = str(path.with_name(f"{path.stem}-imatrix.gguf") if weighed else path)
        if not os.path.exists(path):
            prepare_companion(a.model, low_type, path, threads=threads, imatrix_path=imatrix)
        lows[low] = path
        print(f"{low} copy: {inspect_model(path).expert_bytes_total / info.expert_bytes_total:.2f} of the model's "
              "expert bytes")
    importance = tuple(map(tuple, measure_calibration(a.model, calibration_text(), threads).importance.tolist()))
    with open(a.text, encoding="utf-8") as f:
        reference = measure_reference(a.model, tokenize_text(a.model, f.read(), a.tokens), n_ctx=256, n_threads=threads)
    print(f"{os.path.basename(a.model)}: {len(reference.ids)} held-out tokens, perplexity {reference.perplexity:.3f}; "
          f"within means mean KL <= {MAX_MEAN_KL:g}\n")
    print("| budget | configuration | mean KL | perplexity | MB read a token | selections from the copy |")
    print("|---|---|---|---|---|---|")
    for share in (float(s) for s in a.shares.split(",")):
        mb = share * info.expert_bytes_total / MB
        configs = {"exact (the model's experts)": OffloadConfig(cache_mb=mb, auto=False)}
        for low, path in lows.items():
            configs[f"ladder over {low}"] = OffloadConfig(cache_mb=mb, low=path, hits="found", importance=importance,
                                                          auto=False)
        first = next(iter(lows.values()))
        for t1 in (float(t) for t in a.t1.split(",")):
            configs[f"dynamic over {next(iter(lows))} (T1 {t1:g}, hits exact)"] = OffloadConfig(
                cache_mb=mb, low=first, hits="exact", t1=t1, t2=1.0, auto=False)
            configs[f"dynamic over {next(iter(lows))} (T1 {t1:g}, the default's: hits at-least)"] = OffloadConfig(
                cache_mb=mb, low=first, auto=False, t1=t1, t2=1.0, **DYNAMIC)
        for name, config in configs.items():
            r = evaluate_against(a.model, reference, config, n_ubatch=1, n_threads=threads)
            s = r.stats or {}
            served = s.get("served") or [0]
            low_share = sum(served[1:]) / sum(served) if sum(served) else 0.0
            within = "within" if r.mean_kl <= MAX_MEAN_KL else "beyond"
            print(f"| {share:.2f} | {name} | {r.mean_kl:.4f} ({within}) | {100 * (r.perplexity / reference.perplexity - 1):+.2f} % "
                  f"| {s.get('bytes_read', 0) / r.n_tokens / MB:.3f} | {100 * low_share:.0f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
