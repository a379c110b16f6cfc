"""`hobbitpy tune`: the configuration for a memory size within a mean-KL limit, written as the model's profile."""

from __future__ import annotations

import os

from hobbitpy.measure.tune import tune

from .common import MB, add_force_arg, default_of, fail, profile_inputs, threads_arg


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="choose the precision ladder for a memory size within a mean-KL limit",
                       description="Score candidate precision ladders (the model's experts, or those of smaller quants "
                                   "made by prepare or llama.cpp's quantizer, one or two levels, placed by the routers' "
                                   "weight, the presets) at the expert budget that MEMORY leaves, cheapest first, "
                                   "against the model's own experts on the text (static ones in batches, the others "
                                   "token by token), and write the cheapest one within --max-kl of the model's next-token "
                                   "distributions as the "
                                   "model's profile, which run and hobbitpy.Llama apply by themselves.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--text", required=True, help="UTF-8 held-out text of the kind the model will see")
    p.add_argument("--memory", default="auto", metavar="MB|auto",
                   help="memory the runs will have, in MB (e.g. a container's limit); auto: what is available now")
    p.add_argument("--max-kl", type=float, default=default_of(tune, "max_mean_kl"), metavar="NATS",
                   help="largest mean KL divergence from the model's own next-token distributions on the text, "
                        "in nats a token, the default's own limit (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=default_of(tune, "max_tokens"),
                   help="tokens of the text scored per candidate (default %(default)s)")
    p.add_argument("--ctx", type=int, default=None,
                   help="context length the runs will use (its buffers come out of the memory; default run's: the "
                        "model's training context as far as the memory allows)")
    p.add_argument("--candidates", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=None,
                   metavar="NAME,...", help="score only these candidates (names as printed)")
    p.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="stop scoring after this long, the pass over the text and the files made included, and "
                        "choose among the candidates scored (default: tune.TIME_LIMIT_MINUTES, 15)")
    p.add_argument("--threads", type=threads_arg, default=os.cpu_count() or 1)
    p.add_argument("--out", help="profile file (default: next to the model; a new file unless --force)")
    p.add_argument("--keep", action="store_true",
                   help="keep the copies and quants made for candidates not picked (by default they are removed: "
                        "gigabytes each at real size)")
    add_force_arg(p)
    p.set_defaults(func=_tune)


def _tune(args) -> int:
    from hobbitpy import HobbitError, inspect_model
    from hobbitpy.plan.memory import ContextShape, available_memory_bytes, default_context
    from hobbitpy.measure.tune import check_candidate_names

    out, text, why = profile_inputs(args)
    if why:
        return fail(why)
    try:
        check_candidate_names(args.candidates or [])
    except ValueError as e:
        return fail(str(e))
    try:
        memory = None if args.memory == "auto" else int(float(args.memory) * MB)
    except ValueError:
        return fail(f"--memory must be a number of MB or auto, got {args.memory!r}")
    if memory is not None and memory <= 0:
        return fail(f"--memory must be positive, got {args.memory}")
    if not 0 <= args.max_kl < float("inf"):
        return fail(f"--max-kl must be a number of nats >= 0, got {args.max_kl}")
    if args.time_limit is not None and not args.time_limit > 0:
        return fail(f"--time-limit must be a positive number of minutes, got {args.time_limit}")
    if args.ctx is not None and args.ctx < 16:
        return fail(f"--ctx must be at least 16, got {args.ctx}")
    try:
        n_ctx = args.ctx if args.ctx is not None else default_context(inspect_model(args.model),
                                                                      memory or available_memory_bytes())
        profile, _ = tune(args.model, text, memory_bytes=memory, max_mean_kl=args.max_kl,
                          max_tokens=args.max_tokens, run_shape=ContextShape(n_ctx=n_ctx), threads=args.threads,
                          names=args.candidates,
                          time_limit_s=None if args.time_limit is None else 60 * args.time_limit, keep=args.keep)
        profile.save(out, args.force)
    except (HobbitError, ValueError, OSError) as e:
        return fail(str(e))
    c = profile.calibration
    best = next(r for r in c["candidates"] if r["name"] == c["chosen"])
    print(f"chosen: {c['chosen']} (mean KL {best['mean_kl']:.4f} nats, {100 * best['ppl_increase']:+.2f} % perplexity, "
          f"{best['cost']:.3g} MB per token "
          f"at {best['budget_mb']:.0f} MB of expert cache)")
    print(f"wrote {out}")
    return 0
