"""`hobbitpy prepare`: the low-precision copies of a model's experts, or its uniform quants."""

from __future__ import annotations

import os

from .common import DEFAULT_LOW, MB, fail, threads_arg


def add_parser(sub) -> None:
    p = sub.add_parser("prepare", help="write low-precision copies of a MoE model's experts (mixed precision)",
                       description="Write companion GGUF files holding only the routed expert tensors of MODEL, "
                                   "re-quantized by llama.cpp's quantizer, for mixed-precision expert loading. "
                                   "Each goes next to the model as MODEL.experts-TYPE.gguf unless --out names it; "
                                   "an existing file is never overwritten.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--low", metavar="TYPE",
                   help="type of the low-precision copy (default Q2_K); a llama.cpp mix (Q3_K_M, Q4_K_M, ...) makes "
                        "that uniform quant of the model with llama.cpp's quantizer into MODEL.quants/ instead")
    p.add_argument("--mid", metavar="TYPE", help="also write a mid-precision copy of this type or mix, e.g. Q4_K")
    p.add_argument("--high", metavar="TYPE", help="also write a copy to serve as the high precision, e.g. Q4_K_M")
    p.add_argument("--out", help="output file (only when one copy is written)")
    p.add_argument("--source", metavar="GGUF",
                   help="the same model in higher precision (F16/BF16/F32) to quantize from (default: the model)")
    p.add_argument("--threads", type=threads_arg, default=os.cpu_count() or 1, help="quantizing threads (default: all cores)")
    p.add_argument("--imatrix", metavar="GGUF",
                   help="importance matrix of the model's experts (`hobbitpy imatrix`, or llama-imatrix's GGUF file): "
                        "weighs each column's rounding error as llama-quantize does; needed by IQ2_XXS, IQ2_XS, "
                        "IQ2_S, IQ1_S, IQ1_M")
    p.add_argument("--neuron-layout", action="store_true",
                   help="write only the layout of CORM's neuron-granular reads instead (MODEL.neurons-Q8_0.gguf: the "
                        "experts in Q8_0, down transposed, each neuron's down row after its up row), for run --neurons THETA "
                        "--neuron-layout")
    p.set_defaults(func=_prepare)


def _prepare(args) -> int:
    import collections
    import pathlib
    import time

    from hobbitpy import HobbitError
    from hobbitpy.copies.companions import companion_fallbacks, default_companion_path
    from hobbitpy.copies.prepare import prepare_companion
    from hobbitpy.copies.quants import default_quant_dir, is_mix_name, make_uniform_quant

    if args.neuron_layout:
        if args.mid or args.high or args.imatrix or args.low:
            return fail("--neuron-layout writes the neuron layout alone (Q8_0); --low, --mid, --high and --imatrix "
                         "do not apply")
        try:
            start = time.perf_counter()
            path = prepare_companion(args.model, "Q8_0", args.out, source_path=args.source, threads=args.threads,
                                     neuron_layout=True)
        except (HobbitError, ValueError, OSError) as e:
            return fail(str(e))
        print(f"wrote {path}: {os.path.getsize(path) / MB:.1f} MB in {time.perf_counter() - start:.1f} s")
        return 0
    types = [args.low or DEFAULT_LOW] + [t for t in (args.mid, args.high) if t]
    mixes = [t for t in types if is_mix_name(t)]
    if mixes and (args.out or args.source):
        return fail(f"{', '.join(mixes)}: llama.cpp mixes are whole quants of the model, made into "
                     f"{default_quant_dir(args.model)}; --out and --source apply to companions of one type")
    for mix in mixes:
        try:
            start = time.perf_counter()
            path, made = make_uniform_quant(args.model, mix, default_quant_dir(args.model), args.threads)
        except (HobbitError, ValueError, OSError) as e:
            return fail(str(e))
        print(f"{'wrote' if made else 'already there:'} {path}: {os.path.getsize(path) / MB:.1f} MB"
              + (f" in {time.perf_counter() - start:.1f} s" if made else "") + " (llama.cpp's quantizer; its experts serve as the level)")
    types = [t for t in types if not is_mix_name(t)]
    if not types:
        return 0
    if args.out and len(types) > 1:
        return fail("--out names one file; with --mid or --high each copy is written next to the model under its own name")
    if args.threads < 1:
        return fail(f"--threads must be at least 1, got {args.threads}")
    try:
        outs = [pathlib.Path(args.out)] if args.out else [default_companion_path(args.model, t) for t in types]
        if len(set(outs)) != len(outs):
            return fail(f"--low, --mid and --high name the same type twice ({', '.join(types)})")
        # both checked before the first is written: a second failure must not follow minutes of work
        for out in outs:
            if out.exists():
                return fail(f"{out}: already exists; prepare never overwrites a file")
        for type_name, out in zip(types, outs):
            start = time.perf_counter()
            path = prepare_companion(args.model, type_name, out, source_path=args.source, threads=args.threads,
                                     imatrix_path=args.imatrix)
            seconds = time.perf_counter() - start
            print(f"wrote {path}: {os.path.getsize(path) / MB:.1f} MB in {seconds:.1f} s")
            fallbacks = companion_fallbacks(path)
            for fallback_type, n in collections.Counter(fallbacks.values()).items():
                kinds = sorted({name.split(".", 2)[2] for name, t in fallbacks.items() if t == fallback_type})
                print(f"  fallback: {n} tensors ({', '.join(kinds)}) written as {fallback_type}: "
                      f"their rows are not whole {type_name.upper()} blocks")
    except (HobbitError, ValueError, OSError) as e:
        return fail(str(e))
    return 0
