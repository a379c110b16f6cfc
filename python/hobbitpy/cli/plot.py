"""`hobbitpy plot`: a trace (or its neuron statistics) drawn as a PNG."""

from __future__ import annotations

from .common import add_force_arg, fail


def add_parser(sub) -> None:
    from hobbitpy.analysis.simulate import POLICIES
    from hobbitpy.analysis.trace_plot import DEFAULT_PLOT_POLICIES

    p = sub.add_parser("plot", help="draw where the experts go in a trace (PNG)",
                       description="Draw a routing trace: each layer's selections per expert (heat map), the reuse "
                                   "distance of every selection, and the cumulative hit ratio of cache policies at one "
                                   "budget (the runtime's own policies and Belady's optimum).")
    p.add_argument("trace", help="a trace written by `hobbitpy trace`")
    p.add_argument("--out", help="PNG to write (default: TRACE.png beside the trace; a new file unless --force)")
    add_force_arg(p)
    p.add_argument("--budget-mb", type=float, default=None,
                   help="cache budget of the hit-ratio panel (default: a quarter of every expert)")
    p.add_argument("--policy", nargs="+", choices=POLICIES, default=list(DEFAULT_PLOT_POLICIES),
                   help=f"policies drawn (default: {' '.join(DEFAULT_PLOT_POLICIES)})")
    p.add_argument("--neurons", action="store_true",
                   help="draw the trace's neuron statistics instead (CORM's Fig. 2 and 5b; a trace recorded with "
                        "`trace --neurons`)")
    p.set_defaults(func=_plot)


def _plot(args) -> int:
    import pathlib

    from hobbitpy import HobbitError
    from hobbitpy.system.outputs import new_output_error, write_new
    from hobbitpy.files.trace_file import load_trace
    from hobbitpy.analysis.neuron_plot import plot_neurons
    from hobbitpy.analysis.trace_plot import plot_trace

    try:
        import matplotlib  # the [bench] extra
        del matplotlib
    except ImportError:
        return fail("plot draws with matplotlib, which is not installed: pip install 'hobbitpy[bench]'")
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.trace).with_suffix(".png")
    if why := new_output_error(out, args.force):
        return fail(why)
    try:
        trace = load_trace(args.trace)
        png = plot_neurons(trace) if args.neurons else plot_trace(trace, budget_mb=args.budget_mb, policies=args.policy)
        write_new(out, png, args.force)
    except (HobbitError, ValueError, OSError) as e:
        return fail(str(e))
    print(f"wrote {out}")
    return 0
