"""`hobbitpy inflate`: widen a model with neurons or dimensions that contribute exactly zero."""

from __future__ import annotations

import os

from .common import MB, fail


def add_parser(sub) -> None:
    p = sub.add_parser("inflate", help="widen every expert with neurons, or the hidden size with dimensions, that "
                                       "contribute exactly zero",
                       description="Make each routed expert as large as a real one (n_ff) without changing any "
                                   "output: extra gate/up rows, zero down-projection blocks; or (--n-embd) make its "
                                   "rows as long as a real one's: zero columns and rows along the hidden size, the "
                                   "norms rescaled exactly. Writes a new file.")
    p.add_argument("src", help="input GGUF")
    p.add_argument("dst", help="output GGUF (must not exist)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--n-ff", type=int, help="new width of every expert")
    what.add_argument("--n-embd", type=int, help="new hidden size: the model's times a power of 4 (llama, gpt-oss)")
    p.set_defaults(func=_inflate)


def _inflate(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.files.inflate import inflate, pad_embedding

    try:
        out = inflate(args.src, args.dst, args.n_ff) if args.n_ff else pad_embedding(args.src, args.dst, args.n_embd)
    except (HobbitError, ValueError, FileExistsError) as e:
        return fail(str(e))
    print(f"{out}: {os.path.getsize(out) / MB:.1f} MB")
    return 0
