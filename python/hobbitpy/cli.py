"""The hobbitpy command line: a thin shell over the Python API."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys

MB = 1024 * 1024
log = logging.getLogger("hobbitpy")
DEFAULT_MODEL = "ref-mixtral-Q8_0.gguf"  # models/README.md
DEFAULT_LOW = "Q2_K"  # the low level prepare writes and calibrate reads when none is named
# ggml's GGML_MAX_N_THREADS: more threads overran its arrays (SIGSEGV in libgomp at 100000)
MAX_THREADS = 512


def _threads(text: str) -> int:
    """--threads: 1..MAX_THREADS (argparse says which flag, in one line)."""
    n = int(text)
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_THREADS}, got {n}")
    return n


def _finite(text: str) -> float:
    """A sampling parameter: a finite number (NaN slipped through every comparison)."""
    x = float(text)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return x


def _add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt, or chat",
                       description="Generate text from a prompt (or chat with --chat); routed experts run through a "
                                   "budgeted expert cache. Flags as llama.cpp names them.")
    p.add_argument("model", nargs="?", help="GGUF model file (default: the small mixtral-style model shipped with hobbitpy)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("-p", "--prompt", help="prompt text")
    what.add_argument("--chat", action="store_true", help="an interactive chat with history (Ctrl-D or Ctrl-C ends it)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (per reply with --chat; default 64)")
    _add_sampling_args(p)
    p.add_argument("-t", "--threads", type=_threads, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx", type=int, default=None, help="context length in tokens (default: the model's training context)")
    _add_gpu_layers_arg(p)
    p.add_argument("--no-echo", action="store_true", help="print only the generated text, not the prompt before it")
    add_offload_args(p)
    p.add_argument("--stats-json", metavar="FILE", help="write run statistics as JSON to FILE (a new file)")
    _add_verbosity_args(p)
    p.set_defaults(func=_run)


def _add_gpu_layers_arg(p) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None, metavar="N",
                   help="layers whose non-expert weights go to the GPU, as llama.cpp's -ngl (-1: all; default: all "
                        "when a GPU is usable, else none); the experts' pools are on the GPU whenever there is one")


def _gpu_layers(args) -> int:
    from hobbitpy.devices import default_gpu_layers

    return default_gpu_layers() if args.n_gpu_layers is None else args.n_gpu_layers


def _add_sampling_args(p) -> None:
    g = p.add_argument_group("sampling (llama.cpp's names and defaults)")
    g.add_argument("--temp", type=_finite, default=0.8, help="temperature; 0 = greedy and deterministic (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; 0 = all (default 40)")
    g.add_argument("--top-p", type=_finite, default=0.95, help="nucleus sampling threshold (default 0.95)")
    g.add_argument("--min-p", type=_finite, default=0.05, help="drop tokens below this share of the best one's probability (default 0.05)")
    g.add_argument("--repeat-penalty", type=_finite, default=1.0, help="penalty for repeated tokens; 1 = none (default 1.0)")
    g.add_argument("-r", "--stop", action="append", default=None, metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (default: a random one each run)")


def _add_verbosity_args(p) -> None:
    v = p.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log too")
    v.add_argument("-q", "--quiet", action="store_true", help="no notes on stderr, only errors")


def _sampling(args) -> dict:
    """create_completion's sampling keywords from the flags."""
    return {"temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repeat_penalty": args.repeat_penalty, "stop": args.stop, "seed": args.seed}


def _sampling_error(args) -> str | None:
    if args.n_predict < 1:
        return f"-n must be at least 1, got {args.n_predict}"
    if args.temp < 0 or args.top_k < 0 or not 0 <= args.top_p <= 1 or not 0 <= args.min_p <= 1 or args.repeat_penalty <= 0:
        return "sampling flags out of range (--temp >= 0, --top-k >= 0, --top-p and --min-p in [0, 1], --repeat-penalty > 0)"
    if args.stop is not None and any(not s for s in args.stop):
        return "--stop needs some text"
    return None


def _add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
                       description="Serve the model over HTTP with llama-cpp-python's server (the OpenAI API: "
                                   "/v1/completions, /v1/chat/completions with streaming, /v1/models), its experts "
                                   "through the expert cache; /health, and Prometheus /metrics of the cache.")
    p.add_argument("model", nargs="?", help="GGUF model file (default: the small mixtral-style model shipped with hobbitpy)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--ctx", type=int, default=None, help="context length in tokens (default: the model's training context)")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    _add_gpu_layers_arg(p)
    p.add_argument("--alias", help="the model's name in the API (default: the file path)")
    p.add_argument("--chat-format", help="llama-cpp-python chat format (default: the model's template)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require this bearer token on every route but /health (visible to `ps`: "
                                       "prefer --api-key-file or HOBBITPY_API_KEY)")
    key.add_argument("--api-key-file", metavar="PATH", help="require the bearer token this file holds (its first line)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed to call the server, e.g. http://localhost:3000 (repeatable; "
                        "default none: no web page can)")
    from hobbitpy.config import MAX_BODY_MB

    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_MB,
                   help=f"refuse a request body larger than this many MB (413; default {MAX_BODY_MB:g})")
    add_offload_args(p)
    _add_verbosity_args(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from hobbitpy import HobbitError, inspect_model
    from hobbitpy.serve import serve

    if args.model is None:
        args.model = _default_model()
        if args.model is None:
            return _fail("no model given and no default model installed")
    if not 0 < args.port < 65536:
        return _fail(f"--port must be 1..65535, got {args.port}")
    api_key = args.api_key or os.environ.get("HOBBITPY_API_KEY") or None
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                api_key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            return _fail(f"{args.api_key_file}: cannot read the API key ({e})")
        if not api_key:
            return _fail(f"{args.api_key_file}: its first line is empty, not an API key")
    max_body_mb = args.max_body_mb
    if not 0 < max_body_mb < float("inf"):
        return _fail(f"--max-body-mb must be a positive number, got {args.max_body_mb}")
    try:
        info = inspect_model(args.model)
        n_ctx = args.ctx or info.n_ctx_train or 2048
        if n_ctx < 16:
            return _fail(f"--ctx must be at least 16, got {n_ctx}")
        offload = offload_config_from_args(args, args.model, auto_profile=True)
        log.info(f"serving {args.model} on http://{args.host}:{args.port} (OpenAI API under /v1, /health, /metrics)")
        serve(args.model, offload, host=args.host, port=args.port, n_ctx=n_ctx, n_threads=args.threads,
              n_gpu_layers=_gpu_layers(args), alias=args.alias, chat_format=args.chat_format, api_key=api_key,
              verbose=args.verbose, cors_origins=tuple(args.cors_origin), max_body_mb=max_body_mb)
    except (ValueError, HobbitError, OSError) as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130
    return 0


def _default_model() -> str | None:
    """The small model shipped with hobbitpy, if installed."""
    from hobbitpy._native import DATA_DIR

    default = DATA_DIR / DEFAULT_MODEL
    return str(default) if default.exists() else None


def _numbers(n: int | None, what: str):
    """An argparse type: comma-separated numbers, n of them (None: any count)."""
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected numbers like {what}, got {text!r}") from None
        if n is not None and len(values) != n:
            raise argparse.ArgumentTypeError(f"expected {n} numbers ({what}), got {len(values)}")
        return values
    return parse


def _beam_width(text: str) -> int:
    """--beams: a width 1..beam_search.MAX_WIDTH, or a one-line argparse error."""
    from hobbitpy.beam_search import MAX_WIDTH

    try:
        width = int(text)
    except ValueError:
        width = 0
    if not 1 <= width <= MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"expected a beam width of 1..{MAX_WIDTH}, got {text!r}")
    return width


def _of_trace(measure: str):
    """A parser reading a trace file into per-expert figures (placement.<measure>), or a
    one-line argparse error."""
    def parse(path: str):
        from hobbitpy import HobbitError
        from hobbitpy import placement
        from hobbitpy.trace_file import load_trace

        try:
            return tuple(tuple(row) for row in getattr(placement, measure)(load_trace(path)).tolist())
        except HobbitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


# how an Option's flag text becomes its value, by Option.parse
PARSERS = {
    "numbers4": _numbers(4, "LRU,LFU,LHU,FLD"),
    "numbers": _numbers(None, "0.5,0.5"),
    "trace_importance": _of_trace("expert_importance"),  # --placed
    "trace_popularity": _of_trace("expert_popularity"),  # --popularity
    "float": float,  # a number whose default is None
    "int": int,
}


def _help(f) -> str:
    from hobbitpy.config import default_text, option_of

    opt = option_of(f)
    if opt.negate or f.default is False:
        return opt.help
    return f"{opt.help} (default: {default_text(f)})".replace("%", "%%")


def _dest(f) -> str:
    """Where an offload flag's value goes in the parsed args (apart from run's own --seed, --ctx ...)."""
    return f"offload_{f.name}"


def add_offload_args(p) -> None:
    """The flags that choose how experts are served (run, eval, serve, and bench's --config),
    made from OffloadConfig's Options; each is None unless given, so that a profile and the
    built-in defaults can lie under it."""
    import dataclasses

    from hobbitpy.config import OffloadConfig, option_of
    from hobbitpy.presets import PRESETS

    groups = {}
    for f in dataclasses.fields(OffloadConfig):
        opt = option_of(f)
        if opt.flag is None:
            continue
        target = p
        if opt.group is not None:
            if opt.group not in groups:
                groups[opt.group] = p.add_mutually_exclusive_group()
            target = groups[opt.group]
        if opt.negate or f.default is False:
            target.add_argument(opt.flag, action="store_false" if opt.negate else "store_true", dest=_dest(f),
                                default=None, help=_help(f))
            continue
        kind = PARSERS[opt.parse] if opt.parse else type(f.default) if f.default is not None else str
        target.add_argument(opt.flag, dest=_dest(f), type=kind, default=None, choices=opt.choices,
                            metavar=opt.metavar or (None if opt.choices else opt.flag.lstrip("-").replace("-", "_").upper()),
                            help=_help(f))
        if opt.alias is not None:
            alias, value = opt.alias
            target.add_argument(alias, action="store_const", const=value, dest=_dest(f),
                                help=f"the same as {opt.flag} {value}")
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--profile", metavar="FILE",
                      help="settings from a profile written by `hobbitpy tune` or `calibrate` (run applies "
                           "MODEL.hobbit-profile.json by itself); flags given here win over it")
    prof.add_argument("--no-profile", action="store_true", help="ignore the profile next to the model")
    p.add_argument("--preset", choices=tuple(PRESETS),
                   help="every setting of one paper's method (docs/OPTIONS.md); flags given here win over it, and "
                        "the profile next to the model is not applied")


def offload_config_from_args(args, model_path: str | None = None, *, auto_profile: bool = False):
    """The OffloadConfig of the flags: built-in defaults, then the profile (--profile, or
    with auto_profile and no --preset the one next to model_path), the preset, then the flags
    given."""
    import dataclasses

    from hobbitpy import OffloadConfig
    from hobbitpy.config import option_of
    from hobbitpy.profile import load_profile, profile_path

    settings = {}
    profile = args.profile
    preset = getattr(args, "preset", None)
    if (profile is None and auto_profile and model_path and not args.no_profile and args.offload_enabled is not False
            and preset is None):
        default = profile_path(model_path)
        profile = str(default) if default.exists() else None
    # a profile or a preset chooses the configuration: the default ladder stays out (auto)
    if profile is not None:
        settings.update(load_profile(profile, model_path).settings, auto=False)
        log.info(f"settings from {profile}")
    if preset is not None:
        from hobbitpy.presets import preset_settings

        settings.update(preset_settings(preset), auto=False)
    for f in dataclasses.fields(OffloadConfig):
        if option_of(f).flag is not None and getattr(args, _dest(f)) is not None:
            settings[f.name] = getattr(args, _dest(f))
    return OffloadConfig(**settings)


def parse_bench_config(text: str):
    """bench's --config: NAME or NAME=FLAGS, FLAGS as for `hobbitpy run` (--cache-mb,
    --prefetch, --policy, ...); a ValueError says what is wrong."""
    import dataclasses
    import shlex

    from hobbitpy import HobbitError
    from hobbitpy.bench import STOCK, BenchConfig

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


def _add_bench_parser(sub) -> None:
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
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration and cap (median reported)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to decode per run (default 32)")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1)
    p.add_argument("--quants", type=lambda t: [q for q in t.split(",") if q], default=[], metavar="Q6_K,Q4_K_M,...",
                   help="also run stock llama.cpp on these uniform quants of the model (made by llama.cpp's "
                        "quantizer into --quant-dir, or reused from there): what a user would download instead")
    p.add_argument("--quant-dir", metavar="DIR", help="where the quants are kept (default: MODEL.quants/ next to the model)")
    p.add_argument("--quality", metavar="TEXT",
                   help="score every configuration's perplexity and KL against the model on this held-out text "
                        "(hobbitpy's token by token, with the budget it got under each cap) and print the "
                        "quality-speed frontier per cap; writes frontier.png")
    p.add_argument("--quality-tokens", type=int, default=4096, help="tokens of --quality scored (default 4096)")
    p.add_argument("--tune", metavar="TEXT",
                   help="first run `hobbitpy tune` on this text (keep it apart from --quality's) at every cap's memory "
                        "and benchmark its pick there as the configuration 'tuned'")
    p.add_argument("--tune-candidates", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=None,
                   metavar="NAME,...", help="the candidates tune scores (names as `hobbitpy tune` prints them; default all)")
    p.add_argument("--tune-tokens", type=int, default=1024, help="tokens of --tune scored per candidate (default 1024)")
    p.add_argument("--max-ppl-increase", type=float, default=0.01,
                   help="tune's perplexity budget, as a fraction (default 0.01)")
    p.add_argument("--out", help="output folder for bench.json and the PNGs (default bench-MODEL-TIME; never overwritten)")
    p.add_argument("--prompt-tokens", type=_token_counts, default=None, metavar="16,128,512",
                   help="prompt lengths whose time to first token each run measures; decode follows the shortest "
                        "(default 16,128; the papers add 512)")
    p.add_argument("--beams", type=_beam_width, default=1, metavar="N",
                   help="decode with a beam search of N beams (2-8; Fiddler's beam case): each step decodes every "
                        "beam's next token in one batch; tok/s are then steps/s (default 1: greedy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import pathlib

    from hobbitpy import HobbitError
    from hobbitpy import bench
    from hobbitpy.tune import check_candidate_names

    if args.repeats < 1 or args.n_predict < 2 or args.quality_tokens < 2:
        return _fail("--repeats must be >= 1, -n >= 2 and --quality-tokens >= 2")
    model = args.models[0]
    try:
        from hobbitpy.quants import quant_name

        quants = [quant_name(q) for q in args.quants]
        quality_text = None
        if args.quality:
            quality_text, why = _read_text(args.quality)
            if why:
                return _fail(why)
        tune_request = None
        if args.tune:
            if args.tune_tokens < 16 or not 0 <= args.max_ppl_increase < 1:
                return _fail("--tune-tokens must be >= 16 and --max-ppl-increase in [0, 1)")
            tune_text, why = _read_text(args.tune)
            if why:
                return _fail(why)
            try:
                check_candidate_names(args.tune_candidates or [])
            except ValueError as e:
                return _fail(str(e))
            tune_request = bench.TuneRequest(tune_text, args.tune_candidates, args.tune_tokens, args.max_ppl_increase)
        configs = [parse_bench_config(c) for c in (args.config or ([] if args.tune else ["default"]))]
        if len({c.name for c in configs}) != len(configs):
            return _fail("configuration names must differ")
        if args.tune and any(c.name == bench.TUNED for c in configs):
            return _fail(f"'{bench.TUNED}' is the name of tune's pick; give your configuration another")
        # every model is checked before the first run: a typo in the second must not
        # surface after an hour of measuring the first
        plans = []
        for model in args.models:
            caps = bench.parse_caps(args.caps, args.cap_mb, bench.inspect_model(model).file_bytes)
            if not caps:
                return _fail("no caps given")
            if args.tune and any(c.limit_bytes is None for c in caps):
                return _fail("--tune needs a memory size at every cap: drop 'none' from --caps")
            plans.append((model, caps))
        out = pathlib.Path(args.out) if args.out else bench.default_out_dir(args.models[0])
        bench.check_out_dir(out)
        if len(set(pathlib.Path(m).stem for m in args.models)) != len(args.models):
            return _fail("the models' file names must differ (each gets its own output folder)")
        # SIGTERM unwinds like Ctrl-C: the running worker is killed and the cgroup removed
        # (run_bench's finally); only SIGKILL leaves one, removed by the next bench
        signal.signal(signal.SIGTERM, _interrupt)
        for model, caps in plans:
            result = bench.run_bench(model, configs, caps, repeats=args.repeats, n_predict=args.n_predict,
                                     threads=args.threads, progress=not args.no_progress, quants=quants,
                                     quant_dir=args.quant_dir, quality_text=quality_text,
                                     quality_tokens=args.quality_tokens, tune_request=tune_request,
                                     prompt_tokens=args.prompt_tokens or bench.PROMPT_TOKENS, beams=args.beams)
            # one model: its files in the output folder; several: a folder per model
            target = out if len(plans) == 1 else out / pathlib.Path(model).stem
            for path in bench.write_outputs(result, target):
                print(f"wrote {path}")
    except (HobbitError, ValueError) as e:  # first: a failed write is an OSError that names its file
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{model}: {e.strerror or e}")
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _add_trace_parser(sub) -> None:
    p = sub.add_parser("trace", help="record which experts the routers choose, per token and layer",
                       description="Generate greedily from each prompt and record, per token and MoE layer, the "
                                   "selected experts, gate weights, router probabilities and the experts the next "
                                   "1..4 layers' routers pick on this layer's input. Writes a .npz trace.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--prompts", required=True, help="text file, one prompt per line")
    p.add_argument("--out", required=True, help="trace file to write (.npz; never overwritten)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--lookahead", type=int, default=4, help="layers ahead to record router predictions for (0-4)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1)
    p.add_argument("--neurons", metavar="THETA[,THETA...]", default=None,
                   help="also measure CORM's neuron sparsity at these thresholds (e.g. 0.1,0.175,0.25,0.35): per "
                        "selection, the share of the expert's neurons with |SiLU(W1 x)| > THETA and how well the "
                        "previous MoE layer's input predicts them (SwiGLU models)")
    p.set_defaults(func=_trace)


def _trace(args) -> int:
    import pathlib

    from hobbitpy import HobbitError
    from hobbitpy.config import NEURON_LIMIT_CORM
    from hobbitpy.neurons import format_summary, parse_thetas
    from hobbitpy.trace import read_prompts, record_trace

    from tqdm import tqdm

    from hobbitpy.outputs import new_output_error

    out = pathlib.Path(args.out)
    if why := new_output_error(out):  # before the work: a dangling symlink too
        return _fail(why)
    if out.suffix != ".npz":
        return _fail(f"{out}: a trace is written as .npz; name the file accordingly")
    try:
        thetas = parse_thetas(args.neurons) if args.neurons is not None else ()
        prompts = read_prompts(args.prompts)
        t = record_trace(args.model, prompts, n_predict=args.n_predict, lookahead=args.lookahead, n_ctx=args.ctx,
                         n_threads=args.threads, neuron_thetas=thetas,
                         progress=lambda xs: tqdm(xs, desc="trace", unit="prompt", file=sys.stderr))
        t.save(out)
    except (HobbitError, ValueError) as e:
        return _fail(str(e))
    print(f"{out}: {t.n_tokens} tokens x {t.meta['n_moe_layer']} MoE layers, {len(prompts)} prompts")
    if t.neurons is not None:
        print("neuron sparsity (CORM): mean over selections of the active share |SiLU(W1 x)| > theta, the share "
              "predicted from the previous MoE layer's input, the active neurons it covers (recall), and the share "
              f"of an expert a cold read takes (the whole expert above {NEURON_LIMIT_CORM:.0%} predicted)")
        print(format_summary(t.neurons))
    return 0


def _add_options_parser(sub) -> None:
    p = sub.add_parser("options", help="every option of how experts are served, as a Markdown table",
                       description="Print every offload option: its keyword in hobbitpy.Llama and OffloadConfig, its "
                                   "flag, its default, whether a profile sets it, and what it does; then the presets (docs/OPTIONS.md).")
    p.set_defaults(func=_options)


def _options(args) -> int:
    from hobbitpy.config import options_table
    from hobbitpy.presets import presets_table

    print(options_table() + "\n" + presets_table(), end="")
    return 0


def _add_plot_parser(sub) -> None:
    from hobbitpy.simulate import POLICIES
    from hobbitpy.trace_plot import DEFAULT_PLOT_POLICIES

    p = sub.add_parser("plot", help="draw where the experts go in a trace (PNG)",
                       description="Draw a routing trace: each layer's selections per expert (heat map), the reuse "
                                   "distance of every selection, and the cumulative hit ratio of cache policies at one "
                                   "budget (the runtime's own policies and Belady's optimum).")
    p.add_argument("trace", help="a trace written by `hobbitpy trace`")
    p.add_argument("--out", help="PNG to write (default: TRACE.png beside the trace; never overwritten)")
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
    from hobbitpy.outputs import new_output_error, write_new
    from hobbitpy.trace_file import load_trace
    from hobbitpy.neuron_plot import plot_neurons
    from hobbitpy.trace_plot import plot_trace

    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.trace).with_suffix(".png")
    if why := new_output_error(out):
        return _fail(why)
    try:
        trace = load_trace(args.trace)
        png = plot_neurons(trace) if args.neurons else plot_trace(trace, budget_mb=args.budget_mb, policies=args.policy)
        write_new(out, png)
    except (HobbitError, ValueError, OSError) as e:
        return _fail(str(e))
    print(f"wrote {out}")
    return 0


def _add_simulate_parser(sub) -> None:
    from hobbitpy.presets import PRESETS
    from hobbitpy.simulate import DEFAULT_POLICIES, POLICIES

    p = sub.add_parser("simulate", help="replay a trace through the cache policies and Belady's optimum",
                       description="Replay a routing trace through the runtime's own cache policies (the C++ code) "
                                   "and Belady's offline optimum; print misses, bytes read and miss penalty, each "
                                   "also as a ratio to Belady.")
    p.add_argument("trace", help="a trace written by `hobbitpy trace`")
    p.add_argument("--budget-mb", type=float, nargs="+", required=True, help="expert cache budget(s) in MB")
    p.add_argument("--policy", nargs="+", choices=POLICIES, default=list(DEFAULT_POLICIES),
                   help=f"policies to replay (default: {' '.join(DEFAULT_POLICIES)})")
    p.add_argument("--policy-weights", metavar="LRU,LFU,LHU,FLD", type=_numbers(4, "LRU,LFU,LHU,FLD"),
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
    p.add_argument("--popularity", metavar="TRACE", type=_of_trace("expert_popularity"), default=None,
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
    p.set_defaults(func=_simulate)


def _simulate(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.simulate import format_table, simulate_all, simulate_preset
    from hobbitpy.trace_file import load_trace

    if why := _json_target_error(args.json):
        return _fail(why)
    try:
        t = load_trace(args.trace)
        if args.t1 is not None and not 0 <= args.t1 <= 1:
            return _fail(f"--t1 must be in [0, 1], got {args.t1}")
        if not 0 <= args.substitute <= 1:
            return _fail(f"--substitute must be in [0, 1], got {args.substitute}")
        if args.prefetch_layers < 0:
            return _fail(f"--prefetch-layers must be 0 or more, got {args.prefetch_layers}")
        if args.shallow_layers is not None and args.shallow_layers < 0:
            return _fail(f"--shallow-layers must be 0 or more, got {args.shallow_layers}")
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
        return _fail(str(e))
    m = t.meta
    print(f"{args.trace}: {os.path.basename(m['model'])}, {t.n_tokens} tokens, {m['n_moe_layer']} MoE layers x "
          f"{m['n_expert']} experts (top-{m['n_expert_used']}), {m['expert_bytes'] / MB:.2f} MB per expert, "
          f"{m['expert_bytes_total'] / MB:.0f} MB of experts")
    print(format_table(results))
    if t.predicted.shape[2] > 0:
        from hobbitpy.allocation import layer_prediction_accuracy, shallow_boundary

        accuracy = layer_prediction_accuracy(t)
        print(f"next-layer prediction accuracy per MoE layer: {' '.join(f'{a:.2f}' for a in accuracy)}; "
              f"shallow layers (Fate §4.4): --shallow-layers {shallow_boundary(accuracy)}")
    if args.json and (why := _write_json(args.json, [r.as_dict() for r in results])):
        return _fail(why)
    return 0


def _simulate_neurons(t, args) -> int:
    from hobbitpy.neuron_sim import DEFAULT_GRANULE_BYTES, format_neuron_table, simulate_neurons

    granule = DEFAULT_GRANULE_BYTES if args.read_granule is None else args.read_granule
    results = [r for budget in args.budget_mb for r in simulate_neurons(t, budget, args.neurons, granule_bytes=granule)]
    m = t.meta
    print(f"{args.trace}: {os.path.basename(m['model'])}, {t.n_tokens} tokens, {m['n_moe_layer']} MoE layers x "
          f"{m['n_expert']} experts (top-{m['n_expert_used']}) of {m['n_ff_expert']} neurons, "
          f"{m['expert_bytes'] / MB:.2f} MB per expert, {m['expert_bytes_total'] / MB:.1f} MB of experts")
    print(format_neuron_table(results))
    if args.json and (why := _write_json(args.json, [r.as_dict() for r in results])):
        return _fail(why)
    return 0


def _add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, KL and top-1 agreement against stock on held-out text",
                       description="Perplexity of an offload configuration on a text file, with the mean KL "
                                   "divergence and top-1 agreement against the all-high-precision run (stock "
                                   "llama.cpp), window by window.")
    p.add_argument("model", help="GGUF model file")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--ctx", type=int, default=256, help="window length in tokens (default 256)")
    p.add_argument("--ubatch", type=int, default=None,
                   help="tokens per forward pass (default: the window); 1 scores mixed precision as token-by-token "
                        "decoding uses it")
    p.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1)
    p.add_argument("--no-reference", action="store_true", help="perplexity only, no stock run to compare with")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--neuron-oracle", action="store_true",
                   help="with --no-offload --neurons THETA (CORM priced on a stock context): each layer's own input "
                        "instead of the previous MoE layer's (a perfect predictor)")
    add_offload_args(p)
    p.set_defaults(func=_eval)


def _eval(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.evaluate import evaluate
    from hobbitpy.neurons import NeuronMaskSpec

    from tqdm import tqdm

    if why := _json_target_error(args.json):
        return _fail(why)
    text, why = _read_text(args.text)
    if why:
        return _fail(why)
    try:
        offload = offload_config_from_args(args, args.model)
        neurons = None  # stock's path prices CORM with a graph callback; the runtime masks in its own graph
        if not offload.enabled and offload.neurons is not None:
            neurons = NeuronMaskSpec(offload.neurons, predicted=not args.neuron_oracle, limit=offload.neuron_limit)
        elif args.neuron_oracle:
            raise ValueError("--neuron-oracle goes with --no-offload --neurons THETA")
        r = evaluate(args.model, text, offload, n_ctx=args.ctx, max_tokens=args.max_tokens, n_threads=args.threads,
                     compare_to_reference=not args.no_reference, n_ubatch=args.ubatch, neurons=neurons,
                     progress=lambda xs: tqdm(xs, desc="eval", unit="window", file=sys.stderr))
    except (HobbitError, ValueError) as e:
        return _fail(str(e))
    print(f"{args.model}: {r.n_tokens} tokens scored, offload {'on' if r.offloaded else 'off'}")
    print(f"perplexity            {r.perplexity:.4f}")
    if r.reference_perplexity is not None:
        print(f"reference perplexity  {r.reference_perplexity:.4f}  (stock llama.cpp)")
        print(f"mean KL to reference  {r.mean_kl:.6f} nats")
        print(f"top-1 agreement       {r.top1_agreement * 100:.2f} %")
        if r.log_ppl_ratio_se is not None:
            print(f"perplexity increase   {(r.perplexity / r.reference_perplexity - 1) * 100:+.2f} % "
                  f"(se {r.log_ppl_ratio_se * 100:.2f} points)")
    if r.stats and "neuron_kept_share" in r.stats:
        print(f"neurons kept          {r.stats['neuron_kept_share'] * 100:.1f} % of each selected expert's on average; "
              f"{r.stats['neuron_whole']} of {r.stats['neuron_selections']} selections computed whole")
    elif r.stats:
        hits, misses = r.stats["expert_hits"], r.stats["expert_misses"]
        print(f"expert cache          {hits} hits, {misses} misses (hit ratio {hits / max(1, hits + misses):.3f}), "
              f"{r.stats['n_substituted']} substituted, {r.stats['expert_inplace']} computed in place")
        if (n := r.stats["neuron_selections"]) and r.stats["neuron_reads"]:  # --neuron-layout: read as kept
            print(f"neurons kept          {r.stats['neuron_kept'] / n * 100:.1f} % of each selection's on average, "
                  f"read in {r.stats['neuron_reads']} requests; {r.stats['neuron_whole']} of {n} computed whole")
        elif n:  # the runtime's mask (--neurons): the layers it predicts
            print(f"neurons kept          {r.stats['neuron_kept'] / n * 100:.1f} % of each predicted selection's on "
                  f"average (MoE layers after the first); {r.stats['neuron_whole']} of {n} computed whole")
    if args.json and (why := _write_json(args.json, r.as_dict())):
        return _fail(why)
    return 0


def _add_inflate_parser(sub) -> None:
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
    from hobbitpy.inflate import inflate, pad_embedding

    try:
        out = inflate(args.src, args.dst, args.n_ff) if args.n_ff else pad_embedding(args.src, args.dst, args.n_embd)
    except (HobbitError, ValueError, FileExistsError) as e:
        return _fail(str(e))
    print(f"{out}: {os.path.getsize(out) / MB:.1f} MB")
    return 0


def _add_prepare_parser(sub) -> None:
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
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1, help="quantizing threads (default: all cores)")
    p.add_argument("--imatrix", metavar="GGUF",
                   help="importance matrix of the model's experts (`hobbitpy imatrix`, or llama-imatrix's GGUF file): "
                        "weighs each column's rounding error as llama-quantize does; needed by IQ2_XXS, IQ2_XS, "
                        "IQ2_S, IQ1_S, IQ1_M")
    p.add_argument("--neuron-layout", action="store_true",
                   help="write only the layout of CORM's neuron-granular reads instead (MODEL.neurons-Q8_0.gguf: the "
                        "experts in Q8_0, down transposed, each neuron's down row after its up row), for run --neurons THETA "
                        "--neuron-layout")
    p.set_defaults(func=_prepare)


def _add_imatrix_parser(sub) -> None:
    p = sub.add_parser("imatrix", help="collect the importance matrix of a MoE model's experts on a text",
                       description="Run MODEL (stock llama.cpp) over a text in windows and write the importance "
                                   "matrix of its routed experts (per expert and column, the mean squared input), "
                                   "in llama.cpp's GGUF imatrix layout, for `prepare --imatrix`. Written next to the "
                                   "model as MODEL.imatrix.gguf unless --out names it; never overwrites a file.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--text", required=True, help="UTF-8 calibration text (not the text you evaluate on)")
    p.add_argument("--out", help="output file")
    p.add_argument("--ctx", type=int, default=None,
                   help="window length in tokens (default: 512, at most the model's training context)")
    p.add_argument("--max-tokens", type=int, default=None, help="use at most this many tokens of the text")
    p.add_argument("--threads", type=_threads, default=None)
    p.set_defaults(func=_imatrix)


def _imatrix(args) -> int:
    import time

    from hobbitpy import HobbitError
    from hobbitpy.imatrix import collect_imatrix

    try:
        start = time.perf_counter()
        path = collect_imatrix(args.model, args.text, args.out, n_ctx=args.ctx, max_tokens=args.max_tokens,
                               n_threads=args.threads)
    except (HobbitError, ValueError, OSError) as e:
        return _fail(str(e))
    print(f"wrote {path} in {time.perf_counter() - start:.1f} s")
    return 0


def _prepare(args) -> int:
    import collections
    import pathlib
    import time

    from hobbitpy import HobbitError
    from hobbitpy.companions import companion_fallbacks, default_companion_path
    from hobbitpy.prepare import prepare_companion
    from hobbitpy.quants import default_quant_dir, is_mix_name, make_uniform_quant

    if args.neuron_layout:
        if args.mid or args.high or args.imatrix or args.low:
            return _fail("--neuron-layout writes the neuron layout alone (Q8_0); --low, --mid, --high and --imatrix "
                         "do not apply")
        try:
            start = time.perf_counter()
            path = prepare_companion(args.model, "Q8_0", args.out, source_path=args.source, threads=args.threads,
                                     neuron_layout=True)
        except (HobbitError, ValueError, OSError) as e:
            return _fail(str(e))
        print(f"wrote {path}: {os.path.getsize(path) / MB:.1f} MB in {time.perf_counter() - start:.1f} s")
        return 0
    types = [args.low or DEFAULT_LOW] + [t for t in (args.mid, args.high) if t]
    mixes = [t for t in types if is_mix_name(t)]
    if mixes and (args.out or args.source):
        return _fail(f"{', '.join(mixes)}: llama.cpp mixes are whole quants of the model, made into "
                     f"{default_quant_dir(args.model)}; --out and --source apply to companions of one type")
    for mix in mixes:
        try:
            start = time.perf_counter()
            path, made = make_uniform_quant(args.model, mix, default_quant_dir(args.model), args.threads)
        except (HobbitError, ValueError, OSError) as e:
            return _fail(str(e))
        print(f"{'wrote' if made else 'already there:'} {path}: {os.path.getsize(path) / MB:.1f} MB"
              + (f" in {time.perf_counter() - start:.1f} s" if made else "") + " (llama.cpp's quantizer; its experts serve as the level)")
    types = [t for t in types if not is_mix_name(t)]
    if not types:
        return 0
    if args.out and len(types) > 1:
        return _fail("--out names one file; with --mid or --high each copy is written next to the model under its own name")
    if args.threads < 1:
        return _fail(f"--threads must be at least 1, got {args.threads}")
    try:
        outs = [pathlib.Path(args.out)] if args.out else [default_companion_path(args.model, t) for t in types]
        if len(set(outs)) != len(outs):
            return _fail(f"--low, --mid and --high name the same type twice ({', '.join(types)})")
        # both checked before the first is written: a second failure must not follow minutes of work
        for out in outs:
            if out.exists():
                return _fail(f"{out}: already exists; prepare never overwrites a file")
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
        return _fail(str(e))
    return 0


def _add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure T1/T2 and the cache policy weights for a model; write its profile",
                       description="Record a routing trace on prompts from the text, pick the thresholds T1 (high/low) "
                                   "and T2 (skip) whose perplexity stays within the budget of the all-high run, search "
                                   "the eq. 3 weights that minimize the simulated miss penalty, and write "
                                   "MODEL.hobbit-profile.json, which `hobbitpy run` applies by itself.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--text", required=True, help="UTF-8 text file (held-out text of the kind the model will see)")
    p.add_argument("--low", default=DEFAULT_LOW, metavar="TYPE|PATH",
                   help="the low-precision level (default Q2_K: the file `hobbitpy prepare` writes)")
    p.add_argument("--max-ppl-increase", type=float, default=0.01,
                   help="perplexity budget relative to all-high precision (default 0.01 = 1%%)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens of the text scored per setting (default 2048)")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1)
    p.add_argument("--out", help="profile file (default: next to the model; never overwritten)")
    p.set_defaults(func=_calibrate)


def _calibrate(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.calibrate import calibrate
    from hobbitpy.companions import resolve_level

    out, text, why = _profile_inputs(args)
    if why:
        return _fail(why)
    try:
        low_path = resolve_level(args.model, args.low, "--low")
        result = calibrate(args.model, text, low=args.low, low_path=low_path, max_ppl_increase=args.max_ppl_increase,
                           max_tokens=args.max_tokens, n_threads=args.threads)
        result.profile.save(out)
    except (HobbitError, ValueError, OSError) as e:
        return _fail(str(e))
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


def _add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="choose the precision ladder for a memory size within a perplexity budget",
                       description="Score candidate precision ladders (the model's experts, or those of smaller quants "
                                   "made by prepare or llama.cpp's quantizer, one or two levels, placed by the routers' "
                                   "weight, the presets) at the expert budget that MEMORY leaves, cheapest first, "
                                   "against the model's own experts on the text (static ones in batches, the others "
                                   "token by token), and write the cheapest one within the perplexity budget as the "
                                   "model's profile, which run and hobbitpy.Llama apply by themselves.")
    p.add_argument("model", help="GGUF model file (MoE)")
    p.add_argument("--text", required=True, help="UTF-8 held-out text of the kind the model will see")
    p.add_argument("--memory", default="auto", metavar="MB|auto",
                   help="memory the runs will have, in MB (e.g. a container's limit); auto: what is available now")
    p.add_argument("--max-ppl-increase", type=float, default=0.01,
                   help="largest perplexity increase over stock on the model (default 0.01 = 1%%)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens of the text scored per candidate (default 2048)")
    p.add_argument("--ctx", type=int, default=512,
                   help="context length the runs will use (its buffers come out of the memory; default 512, as run's)")
    p.add_argument("--candidates", type=lambda t: [c.strip() for c in t.split(",") if c.strip()], default=None,
                   metavar="NAME,...", help="score only these candidates (names as printed)")
    p.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="stop scoring after this long, the pass over the text and the files made included, and "
                        "choose among the candidates scored (default: tune.TIME_LIMIT_MINUTES, 15)")
    p.add_argument("--threads", type=_threads, default=os.cpu_count() or 1)
    p.add_argument("--out", help="profile file (default: next to the model; never overwritten)")
    p.set_defaults(func=_tune)


def _tune(args) -> int:
    from hobbitpy import HobbitError
    from hobbitpy.memory import ContextShape
    from hobbitpy.tune import check_candidate_names, tune

    out, text, why = _profile_inputs(args)
    if why:
        return _fail(why)
    try:
        check_candidate_names(args.candidates or [])
    except ValueError as e:
        return _fail(str(e))
    try:
        memory = None if args.memory == "auto" else int(float(args.memory) * MB)
    except ValueError:
        return _fail(f"--memory must be a number of MB or auto, got {args.memory!r}")
    if memory is not None and memory <= 0:
        return _fail(f"--memory must be positive, got {args.memory}")
    if args.time_limit is not None and not args.time_limit > 0:
        return _fail(f"--time-limit must be a positive number of minutes, got {args.time_limit}")
    try:
        profile, _ = tune(args.model, text, memory_bytes=memory, max_ppl_increase=args.max_ppl_increase,
                          max_tokens=args.max_tokens, run_shape=ContextShape(n_ctx=args.ctx), threads=args.threads,
                          names=args.candidates,
                          time_limit_s=None if args.time_limit is None else 60 * args.time_limit)
        profile.save(out)
    except (HobbitError, ValueError, OSError) as e:
        return _fail(str(e))
    c = profile.calibration
    best = next(r for r in c["candidates"] if r["name"] == c["chosen"])
    print(f"chosen: {c['chosen']} ({100 * best['ppl_increase']:+.2f} % perplexity, {best['cost']:.3g} MB per token "
          f"at {best['budget_mb']:.0f} MB of expert cache)")
    print(f"wrote {out}")
    return 0


def _profile_inputs(args) -> tuple[str, str, str | None]:
    """calibrate's and tune's shared checks, before any work: the profile file (never
    overwritten, not even through a symlink), the budget, the text. (out, text, why not)."""
    from hobbitpy.profile import profile_path

    out = args.out or str(profile_path(args.model))
    if os.path.lexists(out):
        return out, "", f"{out}: already exists; a profile is never overwritten (remove it or choose --out)"
    if not 0 <= args.max_ppl_increase < 1:
        return out, "", f"--max-ppl-increase must be in [0, 1), got {args.max_ppl_increase}"
    if args.max_tokens < 16:
        return out, "", f"--max-tokens must be at least 16, got {args.max_tokens}"
    text, why = _read_text(args.text)
    return out, text, why


def _read_text(path: str) -> tuple[str, str | None]:
    """The UTF-8 text of --text, or why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), None
    except (OSError, UnicodeDecodeError) as e:
        return "", f"{path}: cannot read the text ({e})"


def _json_target_error(path: str | None) -> str | None:
    """Why the results cannot go to path (outputs.py: only new files), or None."""
    from hobbitpy.outputs import new_output_error

    return None if path is None else new_output_error(path)


def _write_json(path: str, obj) -> str | None:
    """Write obj as JSON to the new file path; why it could not be written, or None."""
    from hobbitpy.outputs import write_new

    try:
        write_new(path, json.dumps(obj, indent=2) + "\n")
    except OSError as e:  # appeared meanwhile, a full disk, ...
        return str(e) if isinstance(e, FileExistsError) else f"{path}: cannot write it ({e.strerror or e})"
    return None


def _fail(msg: str) -> int:
    print(f"hobbitpy: error: {msg}", file=sys.stderr)
    return 2


def _run(args) -> int:
    import hobbitpy
    from hobbitpy import HobbitError

    if args.model is None:
        args.model = _default_model()
        if args.model is None:
            return _fail("no model given and no default model installed")
    if args.prompt == "":
        return _fail("--prompt is empty: give the text to continue (or --chat)")
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as surrogates
            return _fail(f"--prompt is not valid UTF-8 (at character {e.start}); give it as UTF-8 text")
    if why := _sampling_error(args):
        return _fail(why)
    if args.ctx is not None and args.ctx < 16:
        return _fail(f"--ctx must be at least 16, got {args.ctx}")
    if args.stats_json and (why := _json_target_error(args.stats_json)):
        return _fail(why)

    if args.seed is None:
        # llama-cpp-python would sample with the same seed every run
        import secrets

        args.seed = secrets.randbits(31)
        if args.temp > 0:
            log.info(f"sampling seed {args.seed} (--seed {args.seed} repeats this run)")
    try:
        n_ctx = args.ctx or hobbitpy.inspect_model(args.model).n_ctx_train or 512
        offload = offload_config_from_args(args, args.model, auto_profile=True)
        llm = hobbitpy.Llama(args.model, offload=offload, n_ctx=n_ctx, n_threads=args.threads, verbose=args.verbose,
                             seed=args.seed, n_gpu_layers=_gpu_layers(args))
    except (ValueError, HobbitError) as e:
        return _fail(str(e))
    log.info(llm.offload_plan.reason)

    with llm:
        if args.chat:
            return _chat(llm, args)
        import llama_cpp

        ctx = llm._ctx.ctx
        llama_cpp.llama_perf_context_reset(ctx)
        if not args.no_echo:
            sys.stdout.write(args.prompt)
        try:
            for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict, stream=True, **_sampling(args)):
                sys.stdout.write(chunk["choices"][0]["text"])
                sys.stdout.flush()
        except (HobbitError, ValueError) as e:  # ValueError: llama_cpp's "exceed context window"
            sys.stdout.write("\n")
            return _fail(str(e) if isinstance(e, HobbitError) else f"{args.model}: {e}")
        except KeyboardInterrupt:
            # what was generated stays on screen; no traceback
            sys.stdout.write("\n")
            log.info("interrupted")
            return 130
        sys.stdout.write("\n")
        stats = _run_stats(llm, args.model) | {"seed": args.seed}
    if args.stats_json and (why := _write_json(args.stats_json, stats)):
        return _fail(why)
    return 0


def _chat(llm, args) -> int:
    """An interactive chat with history: a line from the user, the reply streamed."""
    from hobbitpy import HobbitError

    messages = []
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                sys.stdout.write("\n")
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = []
            for chunk in llm.create_chat_completion(messages, max_tokens=args.n_predict, stream=True, **_sampling(args)):
                piece = chunk["choices"][0]["delta"].get("content") or ""
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    except HobbitError as e:  # the model's chat template failed, an expert could not be read
        return _fail(f"{args.model}: {e}")


def _run_stats(llm, model: str) -> dict:
    """--stats-json: tokens, times and the expert cache's counters of the run."""
    import llama_cpp

    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    stats = {
        "model": model,
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
        # per pool (precision level and expert signature): hits, misses, bytes read
        "pools": llm.pool_stats(),
    })
    if s:
        selections = sum(s["served"]) + s["n_skipped"]
        stats.update({
            "n_skipped": s["n_skipped"],
            "prefetch_issued": s["prefetch_issued"],
            "prefetch_used": s["prefetch_used"],
            "prefetch_wasted": s["prefetch_wasted"],
            # share of the selections served at each precision level (0 = the model's own)
            "served_share": [n / selections if selections else 0.0 for n in s["served"]],
            "skipped_share": s["n_skipped"] / selections if selections else 0.0,
        })
    return stats


def main(argv: list[str] | None = None) -> int:
    from hobbitpy import __version__

    parser = argparse.ArgumentParser(prog="hobbitpy", description="Run MoE GGUF models larger than memory.")
    parser.add_argument("--version", action="version", version=f"hobbitpy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_serve_parser(sub)
    _add_inflate_parser(sub)
    _add_prepare_parser(sub)
    _add_imatrix_parser(sub)
    _add_calibrate_parser(sub)
    _add_tune_parser(sub)
    _add_bench_parser(sub)
    _add_trace_parser(sub)
    _add_simulate_parser(sub)
    _add_plot_parser(sub)
    _add_options_parser(sub)
    _add_eval_parser(sub)
    args = parser.parse_args(argv)
    # notes go to stderr through logging (this call's stderr); -q keeps only errors
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hobbitpy: %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.ERROR if getattr(args, "quiet", False) else logging.INFO)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
