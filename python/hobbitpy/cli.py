"""The hobbitpy command line: a thin shell over the Python API."""

from __future__ import annotations

import argparse
import json
import os
import sys

MB = 1024 * 1024
DEFAULT_MODEL = "ref-mixtral-Q8_0.gguf"  # models/README.md


def _add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt",
                       description="Generate text; routed experts run through a budgeted expert cache.")
    p.add_argument("model", nargs="?", help="GGUF model file (default: the small mixtral-style model shipped with hobbitpy)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=0.8, help="sampling temperature; 0 = greedy and deterministic")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    p.add_argument("--ctx", type=int, default=512, help="context length in tokens (default 512)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--cache-mb", type=float, default=None,
                     help="expert cache budget in MB (default: from the memory available)")
    mem.add_argument("--no-offload", action="store_true",
                     help="run stock llama.cpp (every expert mapped from the file): the reference")
    p.add_argument("--prefetch", action="store_true",
                   help="while a layer computes, prefetch the experts the next layer's router picks on its input")
    p.add_argument("--no-direct-io", action="store_true", help="read experts through the page cache")
    p.add_argument("--stats-json", metavar="FILE", help="write run statistics as JSON to FILE")
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    p.set_defaults(func=_run)


def _add_inflate_parser(sub) -> None:
    p = sub.add_parser("inflate", help="widen every expert with neurons that contribute exactly zero",
                       description="Make each routed expert as large as a real one (n_ff) without changing any "
                                   "output: extra gate/up rows, zero down-projection blocks. Writes a new file.")
    p.add_argument("src", help="input GGUF")
    p.add_argument("dst", help="output GGUF (must not exist)")
    p.add_argument("--n-ff", type=int, required=True, help="new width of every expert")
    p.set_defaults(func=_inflate)


def _inflate(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.inflate import inflate

    try:
        out = inflate(args.src, args.dst, args.n_ff)
    except (HobbitError, ValueError, FileExistsError) as e:
        return _fail(str(e))
    print(f"{out}: {os.path.getsize(out) / MB:.1f} MB")
    return 0


def _fail(msg: str) -> int:
    print(f"hobbitpy: error: {msg}", file=sys.stderr)
    return 2


def _run(args) -> int:
    import hobbitpy  # first: it points llama_cpp at the patched library
    from hobbitpy import HobbitError, OffloadConfig

    import llama_cpp

    if args.model is None:
        from hobbitpy._native import DATA_DIR

        default = DATA_DIR / DEFAULT_MODEL
        if not default.exists():
            return _fail(f"no model given and no default model installed ({default})")
        args.model = str(default)
    if args.n_predict < 1:
        return _fail(f"-n must be at least 1, got {args.n_predict}")
    if args.stats_json:
        parent = os.path.dirname(os.path.abspath(args.stats_json))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            return _fail(f"{args.stats_json}: cannot write the statistics there (no such writable directory)")

    try:
        offload = OffloadConfig(enabled=not args.no_offload, cache_mb=args.cache_mb,
                                prefetch_layers=1 if args.prefetch else 0, direct_io=not args.no_direct_io)
    except ValueError as e:
        return _fail(str(e))

    try:
        llm = hobbitpy.Llama(args.model, offload=offload, n_ctx=args.ctx, seed=args.seed,
                             n_threads=args.threads, verbose=args.verbose)
    except HobbitError as e:
        return _fail(str(e))
    print(f"hobbitpy: {llm.offload_plan.reason}", file=sys.stderr)

    with llm:
        ctx = llm._ctx.ctx
        llama_cpp.llama_perf_context_reset(ctx)
        try:
            for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict, temperature=args.temp,
                                               seed=args.seed, stream=True):
                sys.stdout.write(chunk["choices"][0]["text"])
                sys.stdout.flush()
        except HobbitError as e:
            sys.stdout.write("\n")
            return _fail(str(e))
        sys.stdout.write("\n")

        perf = llama_cpp.llama_perf_context(ctx)
        stats = {
            "model": args.model,
            "offload": llm.offloaded,
            "n_prompt_tokens": int(perf.n_p_eval),
            # every sampled token but the last is evaluated, one per decode step
            "n_tokens": int(perf.n_eval) + 1,
            "prefill_ms": float(perf.t_p_eval_ms),
            "decode_tok_s": (perf.n_eval / perf.t_eval_ms * 1000.0) if perf.t_eval_ms > 0 else None,
            "n_decode_evals": int(perf.n_eval),
        }
        s = llm.offload_stats()
        stats.update({
            "expert_hits": s["expert_hits"] if s else 0,
            "expert_misses": s["expert_misses"] if s else 0,
            "expert_inplace": s["expert_inplace"] if s else 0,
            "bytes_read": s["bytes_read"] if s else 0,
            "peak_pool_bytes": s["peak_pool_bytes"] if s else 0,
            "budget_bytes": s["budget_bytes"] if s else 0,
            "runtime": s,
        })
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump(stats, f, indent=2)
            f.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hobbitpy", description="Run MoE GGUF models larger than memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_inflate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
