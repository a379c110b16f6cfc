"""`hobbitpy bench`: stock llama.cpp and hobbitpy side by side under memory caps."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from hobbitpy.bench.bench import run_bench
from hobbitpy.bench.bench_plan import TuneRequest

from .common import (add_force_arg, add_offload_args, beam_width_arg, default_of, fail, interrupt,
                     offload_config_from_args, read_text, threads_arg)


def parse_bench_config(text: str):
    """bench's --config: NAME or NAME=FLAGS, FLAGS as for `hobbitpy run` (--cache-mb,
    --prefetch, --policy, ...); a ValueError says what is wrong."""
    import dataclasses
    import shlex

    from hobbitpy import HobbitError
    from hobbitpy.bench.bench_plan import STOCK, BenchConfig

    name, _, flags = text.partition("=")
    name = name.strip()
    if not name or name == STOCK:
        raise ValueError(f"bad configuration {text!r}: give it a name other than {STOCK!r}")
    p = argparse.ArgumentParser(prog=f"--config {name}=", add_help=False, exit_on_error=False)
    add_offload_args(p)
    try:
        config = offload_config_from_args(p.parse_args(shlex.split(flags)))
    except (argparse.ArgumentError, SystemExit, HobbitError) as e:
        raise ValueError(f"bad flags in configuration {text!r}: {e}") from None
    return BenchConfig(name, dataclasses.asdict(config) if config.enabled else None)


def _token_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of prompt lengths, each 1..4096 tokens (argparse reports a ValueError)."""
    counts = tuple(int(t) for t in text.split(",") if t.strip())
    if not counts or any(not 1 <= n <= 4096 for n in counts):
        raise ValueError(text)
    return tuple(sorted(set(counts)))


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="stock llama.cpp and hobbitpy side by side under memory caps",
                       description="Run stock llama.cpp and hobbitpy configurations on the same model and prompts, "
                                   "interleaved, each run a fresh process under the same memory cap (a child memory "
                                   "cgroup); report medians, ratios to stock and the disk bound; write JSON and a PNG.")
    p.add_argument("models", nargs="+", metavar="MODEL", help="GGUF model file(s); each is measured in turn")
    p.add_argument("--caps", nargs="*", default=["1.0", "0.75", "0.55", "0.40"], metavar="FRACTION",
                   help="memory caps as fractions of the model file's size, or 'none' (default 1.0 0.75 0.55 0.40)")
    p.add_argument("--cap-mb", nargs="*", type=float, default=[], metavar="MB", help="further caps in MB")
    p.add_argument("--config", action="append", default=None, metavar="NAME[=FLAGS]",
                   help="a hobbitpy configuration, e.g. 'lru' or 'lru-prefetch=--prefetch' or "
                        "'lfu=--policy lfu --cache-mb 800' (repeatable; default: 'default', what `run` does with no "
                        "flags). Stock always runs.")
    p.add_argument("--repeats", type=int, default=default_of(run_bench, "repeats"),
                   help="runs per configuration and cap (median reported)")
    p.add_argument("-n", "--n-predict", type=int, default=default_of(run_bench, "n_predict"),
                   help="tokens to decode per run (default %(default)s)")
    p.add_argument("--threads", type=threads_arg, default=os.cpu_count() or 1)
    p.add_argument("--quants", type=lambda t: [q for q in t.split(",") if q], default=[], metavar="Q6_K,Q4_K_M,...",
                   help="also run stock llama.cpp on these uniform quants of the model (made by llama.cpp's "
                        "quantizer into --quant-dir, or reused from there): what a user would download instead")
    p.add_argument("--quant-dir", metavar="DIR", help="where the quants are kept (default: MODEL.quants/ next to the model)")
    p.add_argument("--quality", metavar="TEXT",
                   help="score every configuration's perplexity and KL against the model on this held-out text "
                        "(hobbitpy's token by token, with the budget it got under each cap) and print the "
                        "quality-speed frontier per cap; writes frontier.png")
    p.add_argument("--quality-tokens", type=int, default=default_of(run_bench, "quality_tokens"),
                   help="tokens of --quality scored (default %(default)s)")
    p.add_argument("--tune", metavar="TEXT",
                   help="first run `hobbitpy tune` on this text (keep it apart from --quality's) at every cap's memory "
                        "and benchmark its pick there as the configuration 'tuned'")
    p.add_argument("--tune-candidates", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=None,
                   metavar="NAME,...", help="the candidates tune scores (names as `hobbitpy tune` prints them; default all)")
    p.add_argument("--tune-tokens", type=int, default=TuneRequest.max_tokens,
                   help="tokens of --tune scored per candidate (default %(default)s)")
    p.add_argument("--max-kl", type=float, default=TuneRequest.max_mean_kl, metavar="NATS",
                   help="tune's limit: mean KL from the model's next-token distributions, nats a token "
                        "(default %(default)s)")
    p.add_argument("--out", help="output folder for bench.json and the PNGs (default bench-MODEL-TIME; new "
                                  "files unless --force)")
    add_force_arg(p)
    p.add_argument("--prompt-tokens", type=_token_counts, default=None, metavar="16,128,512",
                   help="prompt lengths whose time to first token each run measures; decode follows the shortest "
                        "(default 16,128; the papers add 512)")
    p.add_argument("--beams", type=beam_width_arg, default=1, metavar="N",
                   help="decode with a beam search of N beams (2-8; Fiddler's beam case): each step decodes every "
                        "beam's next token in one batch; tok/s are then steps/s (default 1: greedy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import pathlib

    from hobbitpy import HobbitError
    from hobbitpy.bench import bench, bench_output, bench_plan
    from hobbitpy.files.model_file import inspect_model
    from hobbitpy.measure.tune import check_candidate_names

    if args.repeats < 1 or args.n_predict < 2 or args.quality_tokens < 2:
        return fail("--repeats must be >= 1, -n >= 2 and --quality-tokens >= 2")
    model = args.models[0]
    try:
        from hobbitpy.copies.quants import quant_name

        quants = [quant_name(q) for q in args.quants]
        quality_text = None
        if args.quality:
            quality_text, why = read_text(args.quality)
            if why:
                return fail(why)
        tune_request = None
        if args.tune:
            if args.tune_tokens < 16 or not 0 <= args.max_kl < float("inf"):
                return fail("--tune-tokens must be >= 16 and --max-kl a number of nats >= 0")
            tune_text, why = read_text(args.tune)
            if why:
                return fail(why)
            try:
                check_candidate_names(args.tune_candidates or [])
            except ValueError as e:
                return fail(str(e))
            tune_request = bench_plan.TuneRequest(tune_text, args.tune_candidates, args.tune_tokens, args.max_kl)
        configs = [parse_bench_config(c) for c in (args.config or ([] if args.tune else ["default"]))]
        if len({c.name for c in configs}) != len(configs):
            return fail("configuration names must differ")
        if args.tune and any(c.name == bench_plan.TUNED for c in configs):
            return fail(f"'{bench_plan.TUNED}' is the name of tune's pick; give your configuration another")
        # every model is checked before the first run: a typo in the second must not
        # surface after an hour of measuring the first
        plans = []
        for model in args.models:
            caps = bench_plan.parse_caps(args.caps, args.cap_mb, inspect_model(model).file_bytes)
            if not caps:
                return fail("no caps given")
            if args.tune and any(c.limit_bytes is None for c in caps):
                return fail("--tune needs a memory size at every cap: drop 'none' from --caps")
            plans.append((model, caps))
        out = pathlib.Path(args.out) if args.out else bench_output.default_out_dir(args.models[0])
        bench_output.check_out_dir(out, args.force)
        if len(set(pathlib.Path(m).stem for m in args.models)) != len(args.models):
            return fail("the models' file names must differ (each gets its own output folder)")
        # SIGTERM unwinds like Ctrl-C: the running worker is killed and the cgroup removed
        # (run_bench's finally); only SIGKILL leaves one, removed by the next bench
        signal.signal(signal.SIGTERM, interrupt)
        command = shlex.join(["hobbitpy", *sys.argv[1:]])
        for model, caps in plans:
            started = bench.now_to_the_minute()
            result = bench.run_bench(model, configs, caps, repeats=args.repeats, n_predict=args.n_predict,
                                     threads=args.threads, progress=not args.no_progress, quants=quants,
                                     quant_dir=args.quant_dir, quality_text=quality_text,
                                     quality_tokens=args.quality_tokens, tune_request=tune_request,
                                     prompt_tokens=args.prompt_tokens or bench_plan.PROMPT_TOKENS, beams=args.beams)
            result.command, result.started, result.finished = command, started, bench.now_to_the_minute()
            # one model: its files in the output folder; several: a folder per model
            target = out if len(plans) == 1 else out / pathlib.Path(model).stem
            for path in bench_output.write_outputs(result, target, args.force):
                print(f"wrote {path}")
    except (HobbitError, ValueError) as e:  # first: a failed write is an OSError that names its file
        return fail(str(e))
    except OSError as e:
        return fail(f"{model}: {e.strerror or e}")
    return 0
