"""`hobbitpy calibrate`: T1/T2 and the policy weights, written as the model's profile."""

from __future__ import annotations

import os

from hobbitpy.measure.calibrate import calibrate

from .common import DEFAULT_LOW, add_force_arg, default_of, fail, profile_inputs, threads_arg


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure T1/T2 and the cache policy weights for a model; write its profile",
                       description="Record a routing trace on prompts from the text, pick the thresholds T1 (high/low) "
                                   "and T2 (skip) whose perplexity stays within the budget of the all-high run, search "
                                   "the eq. 3 weights that minimize the simulated miss penalty, and write "
                                   "MODEL.hobbit-profile.json, which `hobbitpy run` applies by itself.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--text", required=True, help="UTF-8 text file (held-out text of the kind the model will see)")
    p.add_argument("--low", default=DEFAULT_LOW, metavar="TYPE|PATH",
                   help="the low-precision level (default Q2_K: the file `hobbitpy prepare` writes)")
    p.add_argument("--max-ppl-increase", type=float, default=default_of(calibrate, "max_ppl_increase"),
                   help="perplexity budget relative to all-high precision, a fraction (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=default_of(calibrate, "max_tokens"),
                   help="tokens of the text scored per setting (default %(default)s)")
    p.add_argument("--threads", type=threads_arg, default=os.cpu_count() or 1)
    p.add_argument("--out", help="profile file (default: next to the model; a new file unless --force)")
    add_force_arg(p)
    p.set_defaults(func=_calibrate)


def _calibrate(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.copies.companions import resolve_level

    out, text, why = profile_inputs(args)
    if why:
        return fail(why)
    if not 0 <= args.max_ppl_increase < 1:
        return fail(f"--max-ppl-increase must be in [0, 1), got {args.max_ppl_increase}")
    try:
        low_path = resolve_level(args.model, args.low, "--low")
        result = calibrate(args.model, text, low=args.low, low_path=low_path, max_ppl_increase=args.max_ppl_increase,
                           max_tokens=args.max_tokens, n_threads=args.threads)
        result.profile.save(out, args.force)
    except (HobbitError, ValueError, OSError) as e:
        return fail(str(e))
    s = result.profile.settings
    c = result.profile.calibration
    print(f"T1 {s['t1']:.3f}, T2 {s['t2']:.3f}: {c['low_share']:.1%} of selections low, {c['skip_share']:.1%} skipped; "
          f"perplexity {c['perplexity']:.4f} vs {c['reference_perplexity']:.4f} all-high")
    print("policy weights (LRU, LFU, LHU, FLD): " + ", ".join(f"{w:.1f}" for w in s["policy_weights"]))
    budgets = ", ".join(f"{b:.0f}" for b in c["policy_budgets_mb"])
    print(f"miss penalty relative to Belady at {budgets} MB:")
    for row in c["policies"]:
        print(f"  {row['policy']:<20} " + "  ".join(f"{r:5.2f}" for r in row["ratio_to_belady"]))
    print(f"wrote {out}")
    return 0
