"""`hobbitpy trace`: record which experts the routers choose."""

from __future__ import annotations

import os
import sys

from hobbitpy.measure.trace import TRACE_CTX, record_trace
from hobbitpy.system.progress import progress_bar

from .common import add_force_arg, default_of, fail, threads_arg


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="record which experts the routers choose, per token and layer",
                       description="Generate greedily from each prompt and record, per token and MoE layer, the "
                                   "selected experts, gate weights, router probabilities and the experts the next "
                                   "1..4 layers' routers pick on this layer's input. Writes a .npz trace.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--prompts", required=True, help="text file, one prompt per line")
    p.add_argument("--out", required=True, help="trace file to write (.npz; a new file unless --force)")
    add_force_arg(p)
    p.add_argument("-n", "--n-predict", type=int, default=default_of(record_trace, "n_predict"),
                   help="tokens to generate per prompt (default %(default)s)")
    p.add_argument("--lookahead", type=int, default=default_of(record_trace, "lookahead"),
                   help="layers ahead to record router predictions for (0-4; default %(default)s)")
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=default_of(record_trace, "n_ctx"),
                   help=f"context length (default: the model's training context as far as the memory allows, at "
                        f"most {TRACE_CTX})")
    p.add_argument("--threads", type=threads_arg, default=os.cpu_count() or 1)
    p.add_argument("--neurons", metavar="THETA[,THETA...]", default=None,
                   help="also measure CORM's neuron sparsity at these thresholds (e.g. 0.1,0.175,0.25,0.35): per "
                        "selection, the share of the expert's neurons with |SiLU(W1 x)| > THETA and how well the "
                        "previous MoE layer's input predicts them (SwiGLU models)")
    p.set_defaults(func=_trace)


def _trace(args) -> int:
    import pathlib

    from hobbitpy import HobbitError
    from hobbitpy.settings.config import NEURON_LIMIT_CORM
    from hobbitpy.analysis.neurons import format_summary, parse_thetas
    from hobbitpy.measure.trace import read_prompts

    from hobbitpy.system.outputs import new_output_error

    out = pathlib.Path(args.out)
    if why := new_output_error(out, args.force):  # before the work: a dangling symlink too
        return fail(why)
    if out.suffix != ".npz":
        return fail(f"{out}: a trace is written as .npz; name the file accordingly")
    try:
        thetas = parse_thetas(args.neurons) if args.neurons is not None else ()
        prompts = read_prompts(args.prompts)
        t = record_trace(args.model, prompts, n_predict=args.n_predict, lookahead=args.lookahead, n_ctx=args.ctx,
                         n_threads=args.threads, neuron_thetas=thetas,
                         progress=lambda xs: progress_bar(xs, desc="trace", unit="prompt"))
        t.save(out, args.force)
    except (HobbitError, ValueError) as e:
        return fail(str(e))
    print(f"{out}: {t.n_tokens} tokens x {t.meta['n_moe_layer']} MoE layers, {len(prompts)} prompts")
    if t.neurons is not None:
        print("neuron sparsity (CORM): mean over selections of the active share |SiLU(W1 x)| > theta, the share "
              "predicted from the previous MoE layer's input, the active neurons it covers (recall), and the share "
              f"of an expert a cold read takes (the whole expert above {NEURON_LIMIT_CORM:.0%} predicted)")
        print(format_summary(t.neurons))
    return 0
