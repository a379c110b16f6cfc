"""`hobbitpy eval`: perplexity, KL and top-1 agreement against stock."""

from __future__ import annotations

import os
import sys

from hobbitpy.measure.evaluate import evaluate
from hobbitpy.system.progress import progress_bar

from .common import (add_force_arg, add_offload_args, default_of, fail, json_target_error, offload_config_from_args,
                     read_text, threads_arg, write_json)


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, KL and top-1 agreement against stock on held-out text",
                       description="Perplexity of an offload configuration on a text file, with the mean KL "
                                   "divergence and top-1 agreement against the all-high-precision run (stock "
                                   "llama.cpp), window by window.")
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--ctx", type=int, default=default_of(evaluate, "n_ctx"), help="window length in tokens (default %(default)s)")
    p.add_argument("--ubatch", type=int, default=None,
                   help="tokens per forward pass (default: the window); 1 scores mixed precision as token-by-token "
                        "decoding uses it")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    p.add_argument("--threads", type=threads_arg, default=os.cpu_count() or 1)
    p.add_argument("--no-reference", action="store_true", help="perplexity only, no stock run to compare with")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    add_force_arg(p)
    p.add_argument("--neuron-oracle", action="store_true",
                   help="with --no-offload --neurons THETA (CORM priced on a stock context): each layer's own input "
                        "instead of the previous MoE layer's (a perfect predictor)")
    add_offload_args(p)
    p.set_defaults(func=_eval)


def _eval(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.analysis.neurons import NeuronMaskSpec

    if why := json_target_error(args.json, args.force):
        return fail(why)
    text, why = read_text(args.text)
    if why:
        return fail(why)
    try:
        offload = offload_config_from_args(args, args.model, with_stock=("neurons", "neuron_limit"))
        neurons = None  # stock's path prices CORM with a graph callback; the runtime masks in its own graph
        if not offload.enabled and offload.neurons is not None:
            neurons = NeuronMaskSpec(offload.neurons, predicted=not args.neuron_oracle, limit=offload.neuron_limit)
        elif args.neuron_oracle:
            raise ValueError("--neuron-oracle goes with --no-offload --neurons THETA")
        r = evaluate(args.model, text, offload, n_ctx=args.ctx, max_tokens=args.max_tokens, n_threads=args.threads,
                     compare_to_reference=not args.no_reference, n_ubatch=args.ubatch, neurons=neurons,
                     progress=lambda xs: progress_bar(xs, desc="eval", unit="window"))
    except (HobbitError, ValueError) as e:
        return fail(str(e))
    print(f"{args.model}: {r.n_tokens} tokens scored, offload {'on' if r.offloaded else 'off'}")
    print(f"perplexity            {r.perplexity:.4f}")
    if r.reference_perplexity is not None:
        print(f"reference perplexity  {r.reference_perplexity:.4f}  (stock llama.cpp)")
        print(f"mean KL to reference  {r.mean_kl:.6f} nats")
        print(f"top-1 agreement       {r.top1_agreement * 100:.2f} %")
        if r.log_ppl_ratio_se is not None:
            print(f"perplexity increase   {(r.perplexity / r.reference_perplexity - 1) * 100:+.2f} % "
                  f"(se {r.log_ppl_ratio_se * 100:.2f} points)")
    if r.stats and "neuron_kept_share" in r.stats:
        print(f"neurons kept          {r.stats['neuron_kept_share'] * 100:.1f} % of each selected expert's on average; "
              f"{r.stats['neuron_whole']} of {r.stats['neuron_selections']} selections computed whole")
    elif r.stats:
        hits, misses = r.stats["expert_hits"], r.stats["expert_misses"]
        print(f"expert cache          {hits} hits, {misses} misses (hit ratio {hits / max(1, hits + misses):.3f}), "
              f"{r.stats['n_substituted']} substituted, {r.stats['expert_inplace']} computed in place")
        if (n := r.stats["neuron_selections"]) and r.stats["neuron_reads"]:  # --neuron-layout: read as kept
            print(f"neurons kept          {r.stats['neuron_kept'] / n * 100:.1f} % of each selection's on average, "
                  f"read in {r.stats['neuron_reads']} requests; {r.stats['neuron_whole']} of {n} computed whole")
        elif n:  # the runtime's mask (--neurons): the layers it predicts
            print(f"neurons kept          {r.stats['neuron_kept'] / n * 100:.1f} % of each predicted selection's on "
                  f"average (MoE layers after the first); {r.stats['neuron_whole']} of {n} computed whole")
    if args.json and (why := write_json(args.json, r.as_dict(), args.force)):
        return fail(why)
    return 0
