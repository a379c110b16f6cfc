"""`hobbitpy simulate`: a trace replayed through the cache policies and Belady's optimum."""

from __future__ import annotations

import os

from .common import MB, add_force_arg, fail, json_target_error, numbers_arg, of_trace_arg, write_json


def add_parser(sub) -> None:
    from hobbitpy.settings.presets import PRESETS
    from hobbitpy.analysis.simulate import DEFAULT_POLICIES, POLICIES

    p = sub.add_parser("simulate", help="replay a trace through the cache policies and Belady's optimum",
                       description="Replay a routing trace through the runtime's own cache policies (the C++ code) "
                                   "and Belady's offline optimum; print misses, bytes read and miss penalty, each "
                                   "also as a ratio to Belady.")
    p.add_argument("trace", help="a trace written by `hobbitpy trace`")
    p.add_argument("--budget-mb", type=float, nargs="+", required=True, help="expert cache budget(s) in MB")
    p.add_argument("--policy", nargs="+", choices=POLICIES, default=list(DEFAULT_POLICIES),
                   help=f"policies to replay (default: {' '.join(DEFAULT_POLICIES)})")
    p.add_argument("--policy-weights", metavar="LRU,LFU,LHU,FLD", type=numbers_arg(4, "LRU,LFU,LHU,FLD"),
                   default=(0.25, 0.25, 0.25, 0.25),
                   help="weights of HOBBIT's eq. 3 for the hobbit (weighted) policy")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--t1", type=float, default=None,
                   help="mixed precision: a selection whose eq. 2 score is above T1 is wanted at low precision")
    p.add_argument("--low-cost", type=float, default=0.31,
                   help="with --t1: a low-precision miss costs this much of a high one (default 0.31, Q2_K/Q8_0 bytes)")
    p.add_argument("--substitute", type=float, default=0.0, metavar="ALPHA",
                   help="replay the runtime's substitution of low-score misses first (--substitute of `run`, "
                        "importance-driven scheduling; not for belady, whose future is the trace as routed)")
    p.add_argument("--popularity", metavar="TRACE", type=of_trace_arg("expert_popularity"), default=None,
                   help="the popularity policy's profile from another trace of the same model (default: the "
                        "selection counts of the trace replayed, Fiddler's best case)")
    p.add_argument("--shallow-layers", type=int, default=None, metavar="N",
                   help="a pool per MoE layer, each with its own policy, the first N whole while the budget lasts "
                        "(the runtime's --shallow-layers, Fate's arrangement; 0: every layer alike); default one "
                        "shared pool")
    p.add_argument("--prefetch-layers", type=int, default=0, metavar="P",
                   help="replay the decode prefetch too: after each layer, the experts the trace's predictor "
                        "guessed for the next P layers are loaded (their bytes count as read; not for belady)")
    p.add_argument("--preset", nargs="+", choices=list(PRESETS), default=[], metavar="NAME",
                   help=f"also replay these presets' rules ({', '.join(PRESETS)}): policy, substitution, decode "
                        "prefetch and T1's low-precision misses; one shared pool, top-k guesses, no skips (corm: whole "
                        "experts, as the runtime reads them; --neurons replays the neuron cache CORM would read)")
    p.add_argument("--neurons", type=float, metavar="THETA", default=None,
                   help="replay CORM's neuron cache instead, at a threshold the trace recorded (`trace --neurons`): "
                        "bytes per token of whole experts, CORM's predicted neurons, the exactly active ones, and W1 "
                        "whole with the active rest, each cached expert keeping the neurons it read")
    p.add_argument("--read-granule", type=int, default=None, metavar="BYTES",
                   help="with --neurons: the smallest read of the slow tier; a neuron costs the granule it lies on "
                        "(default 4096, a page of a file; 0 = single neurons, a tier that moves bytes)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    add_force_arg(p)
    p.set_defaults(func=_simulate)


def _simulate(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.analysis.simulate import format_table, simulate_all, simulate_preset
    from hobbitpy.files.trace_file import load_trace

    if why := json_target_error(args.json, args.force):
        return fail(why)
    try:
        t = load_trace(args.trace)
        if args.t1 is not None and not 0 <= args.t1 <= 1:
            return fail(f"--t1 must be in [0, 1], got {args.t1}")
        if not 0 <= args.substitute <= 1:
            return fail(f"--substitute must be in [0, 1], got {args.substitute}")
        if args.prefetch_layers < 0:
            return fail(f"--prefetch-layers must be 0 or more, got {args.prefetch_layers}")
        if args.shallow_layers is not None and args.shallow_layers < 0:
            return fail(f"--shallow-layers must be 0 or more, got {args.shallow_layers}")
        if args.neurons is not None:
            return _simulate_neurons(t, args)
        results = simulate_all(t, args.budget_mb, args.policy, weights=args.policy_weights or (0.25,) * 4,
                               seed=args.seed, t1=args.t1, low_miss_cost=args.low_cost,
                               substitute_alpha=args.substitute, popularity=args.popularity,
                               prefetch_layers=args.prefetch_layers, per_layer=args.shallow_layers is not None,
                               shallow_layers=args.shallow_layers or 0)
        presets = [simulate_preset(t, budget, name, popularity=args.popularity, low_miss_cost=args.low_cost)
                   for budget in args.budget_mb for name in args.preset]
        # each budget's rows together: the policies, then the presets
        results = sorted(results + presets, key=lambda r: args.budget_mb.index(r.budget_mb))
    except (HobbitError, ValueError) as e:
        return fail(str(e))
    m = t.meta
    print(f"{args.trace}: {os.path.basename(m['model'])}, {t.n_tokens} tokens, {m['n_moe_layer']} MoE layers x "
          f"{m['n_expert']} experts (top-{m['n_expert_used']}), {m['expert_bytes'] / MB:.2f} MB per expert, "
          f"{m['expert_bytes_total'] / MB:.0f} MB of experts")
    print(format_table(results))
    for note in _zero_hit_notes(results, m):
        print(note)
    if t.predicted.shape[2] > 0:
        from hobbitpy.plan.shallow_layers import layer_prediction_accuracy, shallow_boundary

        accuracy = layer_prediction_accuracy(t)
        print(f"next-layer prediction accuracy per MoE layer: {' '.join(f'{a:.2f}' for a in accuracy)}; "
              f"shallow layers (Fate §4.4): --shallow-layers {shallow_boundary(accuracy)}")
    if args.json and (why := write_json(args.json, [r.as_dict() for r in results], args.force)):
        return fail(why)
    return 0


def _simulate_neurons(t, args) -> int:
    from hobbitpy.analysis.neuron_sim import DEFAULT_GRANULE_BYTES, format_neuron_table, simulate_neurons

    granule = DEFAULT_GRANULE_BYTES if args.read_granule is None else args.read_granule
    results = [r for budget in args.budget_mb for r in simulate_neurons(t, budget, args.neurons, granule_bytes=granule)]
    m = t.meta
    print(f"{args.trace}: {os.path.basename(m['model'])}, {t.n_tokens} tokens, {m['n_moe_layer']} MoE layers x "
          f"{m['n_expert']} experts (top-{m['n_expert_used']}) of {m['n_ff_expert']} neurons, "
          f"{m['expert_bytes'] / MB:.2f} MB per expert, {m['expert_bytes_total'] / MB:.1f} MB of experts")
    print(format_neuron_table(results))
    if args.json and (why := write_json(args.json, [r.as_dict() for r in results], args.force)):
        return fail(why)
    return 0


def _zero_hit_notes(results, meta) -> list[str]:
    """Why a policy hit nothing: a cache with fewer slots than one token selects over every
    layer is cycled through by each token, so LRU (and its kind) evict an expert before the
    next token can want it again."""
    per_token = meta["n_expert_used"] * meta["n_moe_layer"]
    notes = []
    for budget in dict.fromkeys(r.budget_mb for r in results):
        zero = [r.policy for r in results if r.budget_mb == budget and r.accesses and r.hit_ratio == 0]
        n_slot = next(r.n_slot for r in results if r.budget_mb == budget)
        if zero and n_slot < per_token:
            notes.append(f"at {budget:g} MB, {', '.join(zero)} hit nothing: the cache's {n_slot} slots are fewer than "
                         f"the {per_token} experts one token selects over all layers ({meta['n_expert_used']} in each "
                         f"of {meta['n_moe_layer']}), so each expert is evicted before the next token wants it")
    return notes

