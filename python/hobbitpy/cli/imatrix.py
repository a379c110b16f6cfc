"""`hobbitpy imatrix`: the importance matrix of a model's experts on a text."""

from __future__ import annotations

from .common import add_force_arg, fail, threads_arg


def add_parser(sub) -> None:
    p = sub.add_parser("imatrix", help="collect the importance matrix of a MoE model's experts on a text",
                       description="Run MODEL (stock llama.cpp) over a text in windows and write the importance "
                                   "matrix of its routed experts (per expert and column, the mean squared input), "
                                   "in llama.cpp's GGUF imatrix layout, for `prepare --imatrix`. Written next to the "
                                   "model as MODEL.imatrix.gguf unless --out names it; a new file unless --force.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--text", required=True, help="UTF-8 calibration text (not the text you evaluate on)")
    p.add_argument("--out", help="output file")
    add_force_arg(p)
    p.add_argument("--ctx", type=int, default=None,
                   help="window length in tokens (default: 512, at most the model's training context)")
    p.add_argument("--max-tokens", type=int, default=None, help="use at most this many tokens of the text")
    p.add_argument("--threads", type=threads_arg, default=None)
    p.set_defaults(func=_imatrix)


def _imatrix(args) -> int:
    import time

    from hobbitpy import HobbitError, inspect_model
    from hobbitpy.copies.imatrix import collect_imatrix
    from hobbitpy.plan.memory import available_memory_bytes
    from hobbitpy.plan.run_plan import repack_fits

    try:
        start = time.perf_counter()
        # repacked as stock's best run in this memory has it: a 27 GB model's repacked copy does
        # not fit in 24 GB, and the process would be killed
        repack = repack_fits(inspect_model(args.model).file_bytes, available_memory_bytes())
        path = collect_imatrix(args.model, args.text, args.out, n_ctx=args.ctx, max_tokens=args.max_tokens,
                               n_threads=args.threads, replace=args.force, repack=repack)
    except (HobbitError, ValueError, OSError) as e:
        return fail(str(e))
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0
