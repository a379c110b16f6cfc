"""What the commands share: flag groups (threads, sampling, verbosity, the offload options
from OffloadConfig's table), argparse types, and the one-line failure."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import sys

MB = 1024 * 1024
log = logging.getLogger("hobbitpy")
DEFAULT_MODEL = "ref-mixtral-Q8_0.gguf"  # models/README.md
DEFAULT_LOW = "Q2_K"  # the low level prepare writes and calibrate reads when none is named
# ggml's GGML_MAX_N_THREADS: more threads overran its arrays (SIGSEGV in libgomp at 100000)
MAX_THREADS = 512


def default_of(function, parameter: str):
    """A library function's default for a parameter: a command's flag takes it from there, so
    that the default is written once."""
    return inspect.signature(function).parameters[parameter].default


def threads_arg(text: str) -> int:
    """--threads: 1..MAX_THREADS (argparse says which flag, in one line)."""
    n = int(text)
    if not 1 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_THREADS}, got {n}")
    return n


def finite_arg(text: str) -> float:
    """A sampling parameter: a finite number (NaN slipped through every comparison)."""
    x = float(text)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return x


def add_gpu_layers_arg(p) -> None:
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=None, metavar="N",
                   help="layers on the GPU (-1: all; default: all with a GPU)")


def gpu_layers(args) -> int:
    from hobbitpy.system.devices import default_gpu_layers, gpu_usable

    if args.n_gpu_layers not in (None, 0) and not gpu_usable():
        log.info(f"-ngl {args.n_gpu_layers}: no usable GPU here, every layer runs on the CPU")
    return default_gpu_layers() if args.n_gpu_layers is None else args.n_gpu_layers


_METAVARS = {"temperature": "T", "top_k": "K", "top_p": "P", "min_p": "P"}


def add_sampling_args(p) -> None:
    """The sampling flags, llama.cpp's names, each with the default every surface shares
    (generation.GENERATION_DEFAULTS)."""
    from hobbitpy.settings.generation import GENERATION_DEFAULTS

    g = p.add_argument_group("sampling (llama.cpp's names and defaults)")
    for d in GENERATION_DEFAULTS:
        if d.name != "max_tokens":  # -n, among the generation flags
            g.add_argument(d.flag, dest=d.name, type=int if isinstance(d.value, int) else finite_arg, default=d.value,
                           metavar=_METAVARS.get(d.name, "X"), help=f"{d.meaning} (default {d.value:g})")
    g.add_argument("-r", "--reverse-prompt", "--stop", dest="stop", action="append", default=None, metavar="TEXT",
                   help="stop at this text (repeatable)")
    g.add_argument("-s", "--seed", type=int, default=None, metavar="N", help="sampling seed (default: a new one each run)")


def add_n_predict_arg(p) -> None:
    from hobbitpy.settings.generation import DEFAULTS

    p.add_argument("-n", "--n-predict", type=int, default=DEFAULTS["max_tokens"], metavar="N",
                   help="tokens to generate; -1: to the end (default -1)")


def add_verbosity_args(p) -> None:
    v = p.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log too")
    v.add_argument("-q", "--quiet", action="store_true", help="no notes on stderr, only errors")


def sampling_keywords(args) -> dict:
    """create_completion's generation keywords from the flags."""
    from hobbitpy.settings.generation import DEFAULTS

    return {name: getattr(args, "n_predict" if name == "max_tokens" else name) for name in DEFAULTS} | \
        {"stop": args.stop, "seed": args.seed}


_ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "'": b"'", '"': b'"', "\\": b"\\"}


def process_escapes(text: str) -> str:
    """The text with llama.cpp's escapes read (common.cpp's string_process_escapes): \\n, \\r,
    \\t, \\', \\", \\\\ and \\xNN, a byte (\\xc3\\xa9 is one "é": the bytes are read as UTF-8
    together, and a sequence that is no UTF-8 becomes U+FFFD); any other backslash stays as written."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                i += 2
                continue
            if nxt == "x" and len(text) >= i + 4 and all(h in "0123456789abcdefABCDEF" for h in text[i + 2:i + 4]):
                out.append(bytes([int(text[i + 2:i + 4], 16)]))
                i += 4
                continue
        out.append(c.encode("utf-8", "surrogateescape"))
        i += 1
    return b"".join(out).decode("utf-8", "replace")


def sampling_error(args) -> str | None:
    """Why the generation flags cannot be used (the shared rules, said with the flags' names)."""
    from hobbitpy.settings.generation import GENERATION_DEFAULTS, generation_error

    if why := generation_error(sampling_keywords(args)):
        return said_with_flags(why, {d.name: d.flag for d in GENERATION_DEFAULTS} | {"stop": "--stop"})
    return None


def said_with_flags(why: str, flags: dict[str, str]) -> str:
    """A check's words with the flag a person typed in place of the API keyword they start
    with ("cache_mb must be positive" → "--cache-mb must be positive"); flags: keyword → flag."""
    name = why.split(" ", 1)[0]
    return flags[name] + why[len(name):] if name in flags else why


def default_model() -> str | None:
    """The small model shipped with hobbitpy, if installed."""
    from hobbitpy.binding.native import DATA_DIR

    default = DATA_DIR / DEFAULT_MODEL
    return str(default) if default.exists() else None


def numbers_arg(n: int | None, what: str):
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


def beam_width_arg(text: str) -> int:
    """--beams: a width 1..beam_search.MAX_WIDTH, or a one-line argparse error."""
    from hobbitpy.runtime.beam_search import MAX_WIDTH

    try:
        width = int(text)
    except ValueError:
        width = 0
    if not 1 <= width <= MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"expected a beam width of 1..{MAX_WIDTH}, got {text!r}")
    return width


def of_trace_arg(measure: str):
    """A parser reading a trace file into per-expert figures (placement.<measure>), or a
    one-line argparse error."""
    def parse(path: str):
        from hobbitpy import HobbitError
        from hobbitpy.plan import placement
        from hobbitpy.files.trace_file import load_trace

        try:
            return tuple(tuple(row) for row in getattr(placement, measure)(load_trace(path)).tolist())
        except HobbitError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


# how an Option's flag text becomes its value, by Option.parse
PARSERS = {
    "numbers4": numbers_arg(4, "LRU,LFU,LHU,FLD"),
    "numbers": numbers_arg(None, "0.5,0.5"),
    "trace_importance": of_trace_arg("expert_importance"),  # --placed
    "trace_popularity": of_trace_arg("expert_popularity"),  # --popularity
    "float": float,  # a number whose default is None
    "int": int,
}


def _help(f) -> str:
    from hobbitpy.settings.config import default_text, option_of

    opt = option_of(f)
    if opt.brief is not None:
        return opt.brief.replace("%", "%%")
    if opt.negate or f.default is False:
        return opt.help
    return f"{opt.help} (default: {default_text(f)})".replace("%", "%%")


def _dest(f) -> str:
    """Where an offload flag's value goes in the parsed args (apart from run's own --seed, --ctx ...)."""
    return f"offload_{f.name}"


# the offload flags a user needs first (how much memory, or none of it); the rest are the
# papers' techniques
MEMORY_FLAGS = ("--no-offload", "--cache-mb", "--exact", "--no-prepare")


def add_offload_args(p) -> None:
    """The flags that choose how experts are served (run, eval, serve, and bench's --config),
    made from OffloadConfig's Options; each is None unless given, so that a profile and the
    built-in defaults can lie under it."""
    add_memory_args(p)
    add_technique_args(p)


def add_memory_args(p) -> None:
    """MEMORY_FLAGS, the profile and the presets, in a group of their own."""
    from hobbitpy.settings.presets import PRESETS

    g = p.add_argument_group("memory (by default, what the run finds)")
    _add_option_flags(g, lambda flag: flag in MEMORY_FLAGS)
    prof = g.add_mutually_exclusive_group()
    prof.add_argument("--profile", metavar="FILE",
                      help="settings of `hobbitpy tune` (MODEL.hobbit-profile.json applies by itself; flags win)")
    prof.add_argument("--no-profile", action="store_true", help="ignore the profile next to the model")
    g.add_argument("--preset", choices=tuple(PRESETS), metavar="NAME",
                   help=f"one paper's method: {', '.join(PRESETS)} (flags win; no profile)")


def add_technique_args(p) -> None:
    """The other offload flags: the papers' techniques, each with one line (docs/OPTIONS.md has more)."""
    g = p.add_argument_group("expert cache: the papers' techniques (docs/OPTIONS.md)")
    _add_option_flags(g, lambda flag: flag not in MEMORY_FLAGS)


def _add_option_flags(p, wanted) -> None:
    import dataclasses

    from hobbitpy.settings.config import OffloadConfig, option_of

    groups = {}
    for f in dataclasses.fields(OffloadConfig):
        opt = option_of(f)
        if opt.flag is None or not wanted(opt.flag):
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


def offload_config_from_args(args, model_path: str | None = None, *, auto_profile: bool = False,
                             with_stock: tuple[str, ...] = ()):
    """The OffloadConfig of the flags, in profile.resolve_offload's order: the built-in
    defaults, the profile (--profile, or with auto_profile the one next to model_path unless
    --no-profile), the preset, then the flags given. With --no-offload a technique flag or a
    preset is refused (stock llama.cpp would serve every expert and ignore it), except the
    fields the command reads with stock too (with_stock: eval prices --neurons there)."""
    import dataclasses

    from hobbitpy import OffloadConfig
    from hobbitpy.settings.config import option_of
    from hobbitpy.plan.profile import resolve_offload

    flags = {f.name: getattr(args, _dest(f)) for f in dataclasses.fields(OffloadConfig)
             if option_of(f).flag is not None and getattr(args, _dest(f)) is not None}
    if flags.get("enabled") is False:
        ignored = [option_of(OffloadConfig.__dataclass_fields__[name]).flag for name in flags
                   if name != "enabled" and name not in with_stock]
        ignored += [flag for flag, given in (("--profile", args.profile), ("--preset", getattr(args, "preset", None)))
                    if given is not None]
        if ignored:
            raise ValueError(f"{', '.join(ignored)} cannot go with --no-offload: stock llama.cpp serves every "
                             f"expert from the model's file")
    try:
        config, profile = resolve_offload(model_path, profile=args.profile,
                                          profile_next_to_model=auto_profile and not args.no_profile,
                                          preset=getattr(args, "preset", None), settings=flags)
    except ValueError as e:  # a value given by a flag is refused by the flag's name, not the keyword's
        given = {name: option_of(OffloadConfig.__dataclass_fields__[name]).flag for name in flags}
        if (said := said_with_flags(str(e), given)) == str(e):
            raise
        raise ValueError(said) from None
    if profile is not None:
        log.info(f"settings from {profile}")
    return config


def interrupt(signum, frame):
    raise KeyboardInterrupt


def profile_inputs(args) -> tuple[str, str, str | None]:
    """calibrate's and tune's shared checks, before any work: the profile file (never
    overwritten, not even through a symlink), the budget, the text. (out, text, why not)."""
    from hobbitpy.plan.profile import profile_path

    from hobbitpy.system.outputs import new_output_error

    out = args.out or str(profile_path(args.model))
    if why := new_output_error(out, args.force):
        return out, "", why
    if args.max_tokens < 16:
        return out, "", f"--max-tokens must be at least 16, got {args.max_tokens}"
    text, why = read_text(args.text)
    return out, text, why


def read_text(path: str) -> tuple[str, str | None]:
    """The UTF-8 text of --text, or why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), None
    except (OSError, UnicodeDecodeError) as e:
        return "", f"{path}: cannot read the text ({e})"


# --ctx's default, as memory.default_context chooses it
CTX_HELP = "context (default: the model's, as memory allows)"


def add_force_arg(p) -> None:
    p.add_argument("--force", action="store_true", help="replace output files that exist")


def json_target_error(path: str | None, force: bool) -> str | None:
    """Why the results cannot go to path (outputs.py: a new file, or with --force a file
    replaced), or None."""
    from hobbitpy.system.outputs import new_output_error

    return None if path is None else new_output_error(path, force)


def write_json(path: str, obj, force: bool) -> str | None:
    """Write obj as JSON to path (json_target_error's rule); why it could not be written, or None."""
    from hobbitpy.system.outputs import write_new

    try:
        write_new(path, json.dumps(obj, indent=2) + "\n", force)
    except OSError as e:  # appeared meanwhile, a full disk, ...
        return str(e) if isinstance(e, FileExistsError) else f"{path}: cannot write it ({e.strerror or e})"
    return None


def fail(msg: str) -> int:
    print(f"hobbitpy: error: {msg}", file=sys.stderr)
    return 2
