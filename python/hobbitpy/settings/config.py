"""Offload settings as data: validated once, turned into the native struct in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
import json
import math
import numbers
import os
import types
import typing

import numpy as np

from ..binding import hobbit
from ..binding.native import ffi

MB = 1024 * 1024
# the default ladder (default_ladder.py) is served when its mean KL divergence from the
# model's next-token distributions on the calibration text is at most this many nats a token:
# the perplexity increase to expect where the model predicts the text well, about the 1 %
# `tune` and the benchmarks hold a lossy configuration to (on ref-mixtral's held-out text,
# 0.0116 went with +0.83 %, 0.0139 with +1.29 %: docs/BENCHMARKS.md at 5f63b2a)
MAX_MEAN_KL = 0.01
# `serve` refuses a request body larger than this (413) before reading it whole: a 50 MB prompt
# held 3 GB while llama-cpp-python tokenized it, in a process whose point is a memory budget
MAX_BODY_MB = 4.0


def _enum_names(enum: str, prefix: str) -> dict[str, int]:
    """A hobbit.h enum's values by their option names (HOBBIT_MODE_GPU_CENTRIC: gpu-centric), in
    the enum's order: the header is the one list of them."""
    elements = sorted(ffi.typeof(f"enum {enum}").elements.items())
    return {name.removeprefix(prefix).lower().replace("_", "-"): value for value, name in elements}


# cache policies of the runtime (hobbit.h enum hobbit_policy), by name; "hobbit" is
# HOBBIT's multidimensional policy, the weighted mix of eq. 3 ("weighted" is its old name);
# "arc" the adaptive replacement cache Fate uses (§4.4); "popularity" Fiddler's placement
# (the least often selected in a profile evicted first); "score" importance-driven
# scheduling's (the lowest router score over the last tokens evicted first); "frequency" LFU,
# aged, with a profile as its prior (the default's, with the calibration's importance)
def _policy_names() -> dict[str, int]:
    """hobbit_policy's values by name, with "hobbit" beside "weighted" (the same policy)."""
    names = {}
    for name, value in _enum_names("hobbit_policy", "HOBBIT_POLICY_").items():
        names[name] = value
        if name == "weighted":
            names["hobbit"] = value
    return names


_NATIVE_POLICY = _policy_names()
POLICIES = tuple(_NATIVE_POLICY)
# the policies that read a popularity profile: popularity ranks by it, frequency starts from it
PROFILE_POLICIES = ("popularity", "frequency")

# where a missed expert runs (hobbit.h enum hobbit_mode, in its order)
MODES = tuple(_enum_names("hobbit_mode", "HOBBIT_MODE_"))

# the order a prompt loads the next layer's experts in (hobbit.h prefill_popular_first)
PREFILL_ORDERS = ("popularity", "expert")

# what a hit at another precision does (hobbit.h enum hobbit_hit_policy, in its order)
HIT_POLICIES = tuple(_enum_names("hobbit_hit_policy", "HOBBIT_HIT_"))

# the C API's defaults and ranges (hobbit_default_params, hobbit_param_ranges; hobbit-params.cpp)
# are the one table of the runtime's: OffloadConfig's fields that the runtime reads take their
# defaults from it and are checked by its ranges
_C_DEFAULTS = hobbit.default_params()


@dataclass(frozen=True)
class ParamRange:
    """The range of one numeric field of hobbit_params, both ends included (inf: none)."""
    min: float
    max: float
    integer: bool

    def holds(self, x: float) -> bool:
        return self.min <= x <= self.max and not math.isinf(x)  # NaN fails the comparisons

    def text(self) -> str:
        if math.isinf(self.min) and math.isinf(self.max):
            return "finite"
        low = f"{self.min:g}" if not self.integer else str(int(self.min))
        if math.isinf(self.max):
            return f"{low} or more"
        high = f"{self.max:g}" if not self.integer else str(int(self.max))
        return f"{low}..{high}" if self.integer else f"in [{low}, {high}]"


def _param_ranges() -> dict[str, ParamRange]:
    return {name: ParamRange(low, high, integer) for name, low, high, integer in hobbit.param_ranges()}


PARAM_RANGES = _param_ranges()


def _c_float(x: float) -> float:
    """A C float as Python reads it back (0.6f is 0.6000000238...): the shortest decimal that
    is that float32, the number the table was written with."""
    return float(np.format_float_positional(np.float32(x)))


# HOBBIT's thresholds for Mixtral-8x7B (§3.2): 67 % of selections high, 30 % low, 3 % skipped
DEFAULT_T1 = _c_float(_C_DEFAULTS.t1)
DEFAULT_T2 = _c_float(_C_DEFAULTS.t2)
# CORM's upper limit on active neurons for Mixtral 8x7B (its Fig. 9): an expert keeping more runs whole
NEURON_LIMIT_CORM = _c_float(_C_DEFAULTS.neuron_limit)
DEFAULT_POLICY = next(name for name, value in _NATIVE_POLICY.items() if value == _C_DEFAULTS.policy)
_WEIGHTS = _C_DEFAULTS.policy_weights
DEFAULT_POLICY_WEIGHTS = tuple(_c_float(w) for w in (_WEIGHTS.lru, _WEIGHTS.lfu, _WEIGHTS.lhu, _WEIGHTS.fld))
PREFETCH_WIDTH_FATE = hobbit.PREFETCH_WIDTH_FATE
MAX_CACHE_MB = PARAM_RANGES["budget_bytes"].max / MB

# the options that set a ranged field of hobbit_params, and that field. The options in
# NONE_IS_OFF are None when off, which the field spells below 0: given, they are 0 or more
RANGED_OPTIONS = {"prefetch_layers": "prefetch_layers", "prefetch_width": "prefetch_width",
                   "shallow_layers": "shallow_layers", "prefill_low_share": "prefill_low_share",
                   "substitute_alpha": "substitute_alpha", "neurons": "neuron_threshold", "neuron_limit": "neuron_limit",
                   "io_threads": "n_io_threads", "row_readers": "n_row_readers", "neuron_bridge": "neuron_bridge",
                   "t1": "t1", "t_mid": "t_mid", "t2": "t2"}
NONE_IS_OFF = ("shallow_layers", "neurons")


@dataclass(frozen=True)
class Option:
    """How one OffloadConfig field meets users: the one place its help, its flag and whether a
    profile may set it are written (the CLI flags, the keywords of hobbitpy.Llama, the profile
    fields and docs/OPTIONS.md are all made from these)."""

    help: str
    flag: str | None = None        # command-line flag; None: Python and profiles only
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: str | None = None       # how the flag's text becomes the value (cli/common.py PARSERS), else the field's type
    negate: bool = False           # a boolean the flag turns off (--no-warm); else a boolean's flag turns it on
    profile: bool = False          # a profile may set it (what tune and calibrate decide)
    group: str | None = None       # flags of one group exclude each other
    alias: tuple[str, object] | None = None  # another flag that sets a fixed value (--prefetch = --prefetch-layers 1)
    default_text: str | None = None  # how the default reads in help, where the value alone says little
    brief: str | None = None       # the flag's one line in --help, where help is longer (docs/OPTIONS.md has help)


def option(default, help: str, **kw):
    """A field of OffloadConfig with its Option."""
    return field(default=default, metadata={"option": Option(help=help, **kw)})


def option_of(f) -> Option:
    return f.metadata["option"]


def default_text(f) -> str:
    """A field's default as help and docs say it."""
    opt = option_of(f)
    if opt.default_text:
        return opt.default_text
    return ",".join(map(str, f.default)) if isinstance(f.default, tuple) else str(f.default)


def options_table() -> str:
    """Every option as a Markdown table (docs/OPTIONS.md is this; a test keeps them equal)."""
    rows = ["| keyword (`hobbitpy.Llama`, `OffloadConfig`) | flag (`run`, `serve`, `eval`, `bench --config`) | "
            "default | in a profile | what it does |", "|---|---|---|---|---|"]
    for f in fields(OffloadConfig):
        opt = option_of(f)
        flag = f"`{opt.flag}`" + (f" `{opt.metavar}`" if opt.metavar else "") if opt.flag else "–"
        if opt.alias:
            flag += f", `{opt.alias[0]}` (= {opt.alias[1]})"
        if opt.choices:
            flag += " " + "|".join(opt.choices)
        default = "on" if f.default is True else "off" if f.default is False else default_text(f)
        what = f"the flag: {opt.help}" if opt.negate else opt.help
        cells = (f"`{f.name}`", flag, default, "yes" if opt.profile else "", what)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def settings_of_json(settings: dict) -> dict:
    """OffloadConfig keywords from values as JSON gives them (a profile's settings): each
    checked against its field's type (OffloadConfig's checks compare numbers, and a string or a
    list there is a TypeError), lists made tuples; a ValueError names the field and its type."""
    hints = typing.get_type_hints(OffloadConfig)
    out = {}
    for name, value in settings.items():
        if name not in hints:
            raise ValueError(f"{name} is not a setting")
        out[name] = _of_json(hints[name], value)
        if out[name] is _NOT_OF_TYPE:
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ValueError(f"{name} must be {_json_type_name(hints[name])}, got {shown}")
    return out


_NOT_OF_TYPE = object()


def _of_json(hint, value):
    """value as a value of the type hint (JSON's list as a tuple, an integer as a float), or
    _NOT_OF_TYPE."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return next((v for v in (_of_json(a, value) for a in args) if v is not _NOT_OF_TYPE), _NOT_OF_TYPE)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or (args[-1] is not Ellipsis and len(value) != len(args)):
            return _NOT_OF_TYPE
        kinds = (args[0],) * len(value) if args[-1] is Ellipsis else args
        items = tuple(_of_json(kind, v) for kind, v in zip(kinds, value))
        return _NOT_OF_TYPE if any(item is _NOT_OF_TYPE for item in items) else items
    if isinstance(value, bool) and hint is not bool:  # JSON's true is no number
        return _NOT_OF_TYPE
    if hint is float and isinstance(value, numbers.Real):  # numpy's numbers too
        try:
            return float(value)
        except OverflowError:  # an integer of 400 digits
            return _NOT_OF_TYPE
    if hint is int and isinstance(value, numbers.Integral):
        return int(value)
    return value if isinstance(value, hint) else _NOT_OF_TYPE


def _json_type_name(hint, plural: bool = False, python: bool = False) -> str:
    """The type as a profile's JSON spells it, or (python) as Python does."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_json_type_name(a, plural, python) for a in args)
    if origin is tuple:
        count = "" if args[-1] is Ellipsis else f"{len(args)} "
        return ("lists of " if plural else "a list of ") + count + _json_type_name(args[0], True, python)
    names = {type(None): ("None", "Nones") if python else ("null", "nulls"),
             bool: ("True or False" if python else "true or false", "booleans"), int: ("an integer", "integers"),
             float: ("a number", "numbers"), str: ("a string", "strings")}
    return names[hint][plural]


@dataclass(frozen=True)
class OffloadConfig:
    """How the routed experts of a MoE model are served. Every field is documented by its Option
    (`hobbitpy options` prints them all; docs/OPTIONS.md is that table)."""

    enabled: bool = option(True, "run stock llama.cpp instead (every expert mapped from the file): the reference",
                           flag="--no-offload", negate=True, group="memory", brief="stock llama.cpp (the reference)")
    cache_mb: float | None = option(None, "expert cache budget in MiB", flag="--cache-mb", group="memory", parse="float",
                                    default_text="sized from the memory available (cgroup limit or MemAvailable)",
                                    metavar="MB", brief="expert cache in MiB (default: what memory allows)")
    auto: bool = option(True, "serve the model's own experts only (stock's logits bit for bit), instead of what runs "
                              "by default when they do not all fit and nothing else is asked for (no --cache-mb, "
                              "precision level, preset or profile): the experts the routers weigh most on a "
                              "calibration text that ships with hobbitpy at the model's precision and the rest from a "
                              "Q2_K copy (every expert resident where the copy fits), when on that text its next-token "
                              f"distributions stay within {MAX_MEAN_KL} nats of the model's (lossy; default_ladder.py)",
                        flag="--exact", negate=True, brief="the model's own experts: stock's logits bit for bit")
    prepare: bool = option(True, "do not make the Q2_K copy of the experts that the default ladder needs when it is "
                                 "missing (it is made next to the model on first use, the disk it needs checked "
                                 "first): without it, the model's own experts are served",
                           flag="--no-prepare", negate=True, brief="never make the default's Q2_K copy of the experts")
    prefetch_layers: int = option(
        _C_DEFAULTS.prefetch_layers, "during decode, also prefetch the experts the next P layers' routers pick on "
        "the current layer's input, one layer deeper only while those predicted are all cached (HOBBIT's adaptive "
        "prefetch, §3.3); 0 loads on demand only",
        flag="--prefetch-layers", metavar="P", group="depth", alias=("--prefetch", 1), profile=True)
    prefetch_width: int = option(
        _C_DEFAULTS.prefetch_width, "experts prefetched per predicted layer, best first: more than the model's k "
        "widens the set past the router's top-k (Fate §4.3: an expert the prediction misses mostly ranks just below "
        "it), at the cost of loads that may go unused; 0 = k; -1 = Fate's rule, the experts above the 75th "
        "percentile of the predicted scores (a quarter of them), at least k + 1",
        flag="--prefetch-width", metavar="W", profile=True)
    shallow_layers: int | None = option(
        None, "a pool per MoE layer instead of one shared by all (Fate's shallow-favoring allocation, §4.4): the "
              "first N MoE layers hold all of their experts (the next-layer prediction is weakest there), the rest "
              "of the budget is split evenly over the deeper layers, and the policy evicts within a layer; 0 splits "
              "it evenly. The pools hold the highest precision; a lower one (--low) is one pool shared by every "
              "layer. The budget must hold one token's top-k in every layer",
        flag="--shallow-layers", metavar="N", parse="int", default_text="none: one pool shared by every layer", profile=True)
    prefill_order: str = option(
        PREFILL_ORDERS[0] if _C_DEFAULTS.prefill_popular_first else PREFILL_ORDERS[1], "the order a prompt loads the "
        "next MoE layer's experts in while a layer computes, as many as its pool has room for: by how many of the "
        "prompt's tokens that layer's router is predicted to send to each, most first (popularity: Fate §4.5; needs "
        "--prefetch-layers 1 or more, else expert order), or expert by expert (expert)",
        flag="--prefill-order", choices=PREFILL_ORDERS, profile=True)
    prefill_low_share: float = option(
        _c_float(_C_DEFAULTS.prefill_low_share), "Fate's popularity-aware hybrid quantization (§4.5; lossy; needs "
        "--low): in a prompt, the experts fewest of its tokens select, taken while their tokens make up at most this "
        "share of the prompt's selections, are served from the lowest precision (and the next layer's predicted "
        "least popular are prefetched there); 0 = off",
        flag="--prefill-low-share", metavar="SHARE", parse="float", profile=True)
    substitute_alpha: float = option(
        _c_float(_C_DEFAULTS.substitute_alpha), "importance-driven scheduling's expert-cache router (its Algorithm "
        "1; lossy): in decode, a selection scoring below (1 + ALPHA) times the best unselected expert's score that "
        "is not cached is served by the best cached unselected expert scoring within (1 - ALPHA) of it instead, the "
        "gate weights renormalized; the paper runs 0.25-0.35; 0 = off (exact)",
        flag="--substitute", metavar="ALPHA", parse="float", profile=True)
    neurons: float | None = option(
        None, "CORM's neuron sparsity (lossy): in every MoE layer after the first, the neurons of a selected expert "
              "whose |SiLU(W1 x')| is below THETA add nothing, x' the token's input to the previous MoE layer (CORM's "
              "prediction one layer ahead, through the layer's own W1); the paper runs 0.1-0.35. Experts are still "
              "read and multiplied whole, the prediction adds a gate projection; with --neuron-layout they are read "
              "neuron by neuron instead (docs/BENCHMARKS.md at 5f63b2a, CORM); 0 keeps every neuron (exact)",
        flag="--neurons", metavar="THETA", parse="float", profile=True, default_text="off (exact)")
    neuron_limit: float = option(NEURON_LIMIT_CORM, "with --neurons: an expert keeping more than this share of its "
                                                    "neurons runs whole (CORM's upper limit)",
                                 flag="--neuron-limit", metavar="SHARE", profile=True)
    neuron_layout: str | None = option(
        None, "with --neurons: read the experts neuron by neuron from this companion (`hobbitpy prepare "
              "--neuron-layout`: down stored transposed, each neuron's down row after its up row; lossy, down "
              "re-quantized per neuron): each expert's gate projection whole, then only the neurons whose |SiLU| "
              "reaches THETA, in every MoE layer (W1 first, no prediction), a run of neurons one read; the cache "
              "keeps the rows read, its budget counting rows, and an expert reads only the neurons it lacks",
        flag="--neuron-layout", metavar="PATH", profile=True, default_text="none: whole experts")
    direct_io: bool = option(
        bool(_C_DEFAULTS.direct_io), "read experts through the page cache instead of with O_DIRECT (O_DIRECT avoids "
        "caching them twice)", flag="--no-direct-io", negate=True)
    io_threads: int = option(
        _C_DEFAULTS.n_io_threads, "threads reading experts: 2 keeps the disk busy while one copies out of its buffer",
        flag="--io-threads", metavar="N")
    row_readers: int = option(
        _C_DEFAULTS.n_row_readers, "with --neuron-layout: threads reading neuron rows beside --io-threads, each with "
        "a 64 KB buffer (counted in the budget): rows are many reads of tens of KB, which a disk serves at its "
        "bandwidth only with many in flight (docs/BENCHMARKS.md at 5f63b2a, CORM); 0: the --io-threads read them",
        flag="--row-readers", metavar="N")
    neuron_bridge: int = option(
        _C_DEFAULTS.neuron_bridge, "with --neuron-layout: read a gap of at most N rows between two runs of kept "
        "neurons with them, one request instead of two for the gap's bytes (for a disk whose small requests are "
        "dear); 0: the kept rows only", flag="--neuron-bridge", metavar="N")
    policy: str | None = option(
        None, "which cached expert to evict (hobbit: HOBBIT's eq. 3 mix of lru, lfu, lhu and fld; weighted "
        "is its old name; arc: adaptive replacement, as Fate evicts; popularity: the least often selected in a "
        "profile (--popularity), Fiddler's placement; score: the lowest router score over the last tokens, selected "
        "or not, importance-driven scheduling's; frequency: the least often selected in this run, aged, a profile "
        "(--popularity, optional) counting as a few tokens' selections before the first)", flag="--policy",
        choices=POLICIES, profile=True,
        default_text="frequency, its prior the calibration the default keeps next to the model "
                     "(MODEL.hobbit-importance.json), where the experts are served at the model's precision and one "
                     f"is kept; else {DEFAULT_POLICY}")
    policy_weights: tuple[float, float, float, float] = option(
        DEFAULT_POLICY_WEIGHTS, "weights of LRU, LFU, LHU and FLD in HOBBIT's eq. 3 (--policy hobbit); they sum to 1",
        flag="--policy-weights", metavar="LRU,LFU,LHU,FLD", parse="numbers4", profile=True)
    seed: int = option(
        _C_DEFAULTS.seed, "seed of the random policy", flag="--policy-seed", metavar="N")
    low: str | None = option(None, "mixed precision (HOBBIT §3.2): low-precision copies of the experts, a ggml type "
                                   "(Q2_K: the companion `hobbitpy prepare` writes next to the model), a llama.cpp "
                                   "mix (Q2_K_S, Q3_K_M: the uniform quant in MODEL.quants/) or a GGUF file of the "
                                   "model's experts", flag="--low", metavar="TYPE|PATH", profile=True,
                             default_text="none: one precision")
    mid: str | None = option(None, "a middle precision level between the high one and --low (e.g. Q4_K)",
                             flag="--mid", metavar="TYPE|PATH", profile=True, default_text="none")
    high: str | None = option(None, "serve the high precision from a companion too (a precision ladder, e.g. Q4_K or "
                                    "Q4_K_M over a Q8_0 model): the model file's experts are then never read; its other "
                                    "weights keep their precision", flag="--high", metavar="TYPE|PATH", profile=True,
                              default_text="the model's own experts")
    t1: float = option(DEFAULT_T1, "a missed expert whose score (HOBBIT eq. 2) is at most T1 loads at high precision",
                       flag="--t1", profile=True)
    t_mid: float | None = option(None, "with --mid: a score at most T_MID loads at the middle precision",
                                 flag="--t-mid", parse="float", profile=True, default_text="halfway from T1 to T2")
    t2: float = option(DEFAULT_T2, "a missed expert whose score is above T2 is skipped (it adds nothing to that token)",
                       flag="--t2", profile=True)
    skip_cached: bool = option(
        bool(_C_DEFAULTS.skip_cached), "skip a selection whose score is above T2 even when its expert is in memory, "
        "with any number of precisions or a placement: saves its compute, what a resident expert costs (lossy; "
        "HOBBIT skips a missed expert only, to save its load)", flag="--skip-cached", profile=True)
    level_shares: tuple[float, ...] | None = option(
        None, "how the expert budget is split among the precision levels, high first", flag="--level-shares",
        metavar="HIGH,[MID,]LOW", parse="numbers", profile=True,
        default_text="room for every expert at the lowest precision, up to 85 % of the budget, the rest to the others; "
                     "with prefill_low_share and T1 = 1, room for two layers' share of a prompt's experts, up to 15 %")
    hits: str = option(
        HIT_POLICIES[_C_DEFAULTS.hit_policy], "a hit at another precision than wanted: use it (found), use it and "
        "load the wanted one in the background when it was lower, one a token from a layer that loads nothing "
        "(upgrade), serve exactly the wanted precision (exact: the rule's own effect on quality), or use it only when "
        "it is the wanted precision or a higher one, else load the wanted one (at-least: HOBBIT's dynamic loading "
        "for misses, the model's precision kept for every hit it has: no selection served below what exact serves it)",
        flag="--hits", choices=HIT_POLICIES, profile=True)
    mode: str = option(
        MODES[_C_DEFAULTS.mode], "where a missed expert runs: loaded into the cache (gpu-centric), computed in place "
        "on the mapped model file (cooperative), chosen per expert and ubatch by a latency model measured at "
        "start-up (auto; measured up to 1.5x slower under tight caps), or a wave's misses split so loads and "
        "in-place reads take even time, the widest batches loaded (balanced: importance-driven scheduling's "
        "Algorithm 2). Auto and balanced follow timings, so with several precisions they serve a hit at its "
        "wanted precision only (--hits exact): the same text gives the same logits", flag="--mode", choices=MODES)
    warm: bool = option(
        bool(_C_DEFAULTS.warm_low), "do not fill the lowest precision's pool in the background at start",
        flag="--no-warm", negate=True, profile=True)
    importance: tuple[tuple[float, ...], ...] | None = option(
        None, "place the experts statically by how much the routers weigh them (per MoE layer, the sum of each "
              "expert's squared gate weight; on the command line: from a `hobbitpy trace`): the most weighed at the "
              "highest level the budget holds, the rest at the lowest, each always served at its level (T1 "
              "unused; T2 skips only with --skip-cached). With a budget for a copy of every expert, a "
              "mixed-precision model resident in memory (placement.py)",
        flag="--placed", metavar="TRACE", parse="trace_importance", profile=True,
        default_text="none: the thresholds decide per selection")
    placed_mb: float | None = option(
        None, "with --placed: place the experts as an expert cache of this many MB would hold them, whatever the "
              "cache's size (a smaller cache reads the rest as they are wanted, each at its level): the default ladder "
              "measures the placement a run will serve in less memory", flag="--placed-mb", parse="float",
        default_text="the expert cache's size")
    popularity: tuple[tuple[float, ...], ...] | None = option(
        None, "Fiddler's profile for the popularity policy: how often each expert is selected (per MoE layer; on the "
              "command line: counted in a `hobbitpy trace` of calibration text). The pools are warmed most popular "
              "first and the least popular cached expert is evicted, so the popular ones stay for the session; the "
              "frequency policy takes it as its prior (warmed the same way)",
        flag="--popularity", metavar="TRACE", parse="trace_popularity", profile=True,
        default_text="none (the popularity policy needs it)")

    def __post_init__(self) -> None:
        for name in ("importance", "popularity"):  # lists (a profile's JSON) are kept as tuples: the config stays hashable
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(tuple(float(x) for x in row) for row in getattr(self, name)))
        if isinstance(self.level_shares, list):  # a profile's JSON list (the fate preset's split)
            object.__setattr__(self, "level_shares", tuple(self.level_shares))
        for name, hint in _SCALAR_HINTS.items():  # the checks below compare: Llama(cache_mb="4") is told so
            value = _of_json(hint, getattr(self, name))
            if value is _NOT_OF_TYPE:
                raise TypeError(f"{name} must be {_json_type_name(hint, python=True)}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)  # numpy's numbers as Python's: a profile writes them as JSON
        if self.cache_mb is not None and not 0 < self.cache_mb <= MAX_CACHE_MB:
            raise ValueError(f"cache_mb must be positive and at most {MAX_CACHE_MB:.0f} MiB (a PiB), got {self.cache_mb}")
        for name, c_field in RANGED_OPTIONS.items():
            value, allowed = getattr(self, name), PARAM_RANGES[c_field]
            if value is None:
                continue
            if name in NONE_IS_OFF:
                allowed = ParamRange(max(allowed.min, 0), allowed.max, allowed.integer)
            if not allowed.holds(value):
                raise ValueError(f"{name} must be {allowed.text()}, got {value}")
        if self.shallow_layers is not None and self.importance is not None:
            raise ValueError("a pool per layer (shallow_layers) and experts placed by importance do not go together")
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"unknown cache policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        w = self.policy_weights
        if len(w) != 4 or not all(0 <= x <= 1 for x in w) or abs(sum(w) - 1.0) > 1e-6:  # NaN fails 0 <= x
            raise ValueError(f"policy_weights must be four non-negative weights (LRU, LFU, LHU, FLD) summing to 1, got {w}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.neuron_layout is not None and (self.neurons is None or self.high or self.mid or self.low):
            raise ValueError("a neuron layout (neuron_layout) needs a neuron threshold (neurons) and serves as the only "
                             "precision level (no high, mid or low)")
        if self.prefill_low_share > 0.0 and self.n_level < 2:
            raise ValueError("a low-precision share of a prompt's experts (prefill_low_share) needs a low precision "
                             "level (low)")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"unknown prefill order {self.prefill_order!r}; choose one of {', '.join(PREFILL_ORDERS)}")
        if self.hits not in HIT_POLICIES:
            raise ValueError(f"unknown hit policy {self.hits!r}; choose one of {', '.join(HIT_POLICIES)}")
        if self.mid is not None and self.low is None:
            raise ValueError("a middle precision (mid) needs a low one (low) below it")
        if not self.t1 <= self.t2:
            raise ValueError(f"thresholds must satisfy t1 <= t2, got t1 {self.t1}, t2 {self.t2}")
        if self.t_mid is not None and not self.t1 <= self.t_mid <= self.t2:
            raise ValueError(f"t_mid must lie between t1 and t2, got {self.t_mid}")
        if self.importance is not None:
            rows = self.importance
            if self.n_level < 2:
                raise ValueError("placing experts by importance needs at least two precision levels (a low one)")
            if not rows or any(len(row) != len(rows[0]) or not row for row in rows):
                raise ValueError("importance gives every MoE layer the same number of experts (one weight each)")
            if not all(0.0 <= x < float("inf") for row in rows for x in row):
                raise ValueError("importance weights must be finite and non-negative")
        if self.placed_mb is not None:
            if self.importance is None:
                raise ValueError("placed_mb places the experts by importance: it needs --placed")
            if not 0 < self.placed_mb < float("inf"):
                raise ValueError(f"placed_mb must be a positive number of MB, got {self.placed_mb}")
        if self.policy == "popularity" and self.popularity is None:
            raise ValueError("the popularity policy needs a popularity profile (--popularity TRACE)")
        if self.popularity is not None and self.policy not in PROFILE_POLICIES:
            raise ValueError(f"a popularity profile is read by the {' and '.join(PROFILE_POLICIES)} policies only "
                             f"(--policy {PROFILE_POLICIES[0]})")
        if self.popularity is not None:
            rows = self.popularity
            if not rows or any(len(row) != len(rows[0]) or not row for row in rows):
                raise ValueError("popularity gives every MoE layer the same number of experts (one count each)")
            if not all(0.0 <= x < float("inf") for row in rows for x in row):
                raise ValueError("popularity counts must be finite and non-negative")
        if self.level_shares is not None:
            if (len(self.level_shares) != self.n_level or not all(0 <= x < math.inf for x in self.level_shares)
                    or sum(self.level_shares) <= 0):
                raise ValueError(f"level_shares must be {self.n_level} non-negative numbers (one per precision level, "
                                 f"high first) with a positive sum, got {self.level_shares}")

    @property
    def lossy(self) -> bool:
        """May the outputs differ from stock llama.cpp's: experts served at another precision
        (a companion level), substituted by others (substitute_alpha) or neurons left out (neurons)?"""
        return (self.high is not None or self.n_level > 1 or self.substitute_alpha > 0
                or (self.neurons is not None and self.neurons > 0) or self.neuron_layout is not None)

    @property
    def high_file(self) -> str | None:
        """What serves the high level: a neuron layout, a --high companion, or None (the model's experts)."""
        return self.neuron_layout if self.neuron_layout is not None else self.high

    @property
    def high_flag(self) -> str:
        """The option that names high_file (for messages)."""
        return "--neuron-layout" if self.neuron_layout is not None else "--high"

    @property
    def cache_policy(self) -> str:
        """The policy the runtime evicts by: the one chosen, else the runtime's default (a run
        serving the model's own experts chooses first: default_ladder.with_kept_prior)."""
        return self.policy or DEFAULT_POLICY

    @property
    def n_level(self) -> int:
        """Precision levels: the model's own, then mid and low when given."""
        return 1 + (self.low is not None) + (self.mid is not None)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.cache_mb is None else int(self.cache_mb * MB)

    def to_native(self, budget_bytes: int, level_paths: tuple[str | None, ...] = (None,), page_cache_room_bytes: int = -1,
                  placement: tuple[tuple[int, ...], ...] | None = None, cpu_repack: bool = True):
        """The hobbit_params struct for a budget in bytes, and the C strings and arrays it points
        to (keep them alive until the model has loaded). level_paths: the file of each level,
        high to low, None for the model's own experts (see companions.resolve_levels);
        placement: the level of every expert (placement.place_by_importance), or None;
        cpu_repack: whether the model is loaded with llama.cpp's repacking buffers (its
        use_extra_bufts), which the pools then use too."""
        if len(level_paths) != self.n_level or None in level_paths[1:]:
            raise ValueError(f"{self.n_level} level files expected (the first may be None), got {level_paths}")
        params = hobbit.default_params()
        params.budget_bytes = budget_bytes
        params.prefetch_layers = self.prefetch_layers
        params.prefetch_width = self.prefetch_width
        params.shallow_layers = -1 if self.shallow_layers is None else self.shallow_layers
        params.prefill_popular_first = self.prefill_order == "popularity"
        params.prefill_low_share = self.prefill_low_share
        params.substitute_alpha = self.substitute_alpha
        params.neuron_threshold = -1.0 if self.neurons is None else self.neurons
        params.neuron_limit = self.neuron_limit
        params.neuron_reads = self.neuron_layout is not None
        params.direct_io = self.direct_io
        params.cpu_repack = cpu_repack
        params.n_io_threads = self.io_threads
        params.n_row_readers = self.row_readers
        params.neuron_bridge = self.neuron_bridge
        params.policy = _NATIVE_POLICY[self.cache_policy]
        params.policy_weights = {"lru": self.policy_weights[0], "lfu": self.policy_weights[1],
                                 "lhu": self.policy_weights[2], "fld": self.policy_weights[3]}
        params.seed = self.seed
        params.n_level = self.n_level
        keep = []
        for level, path in enumerate(level_paths):
            if path is not None:
                keep.append(ffi.new("char[]", os.fsencode(path)))
                params.level_paths[level] = keep[-1]
        for level, share in enumerate(self.level_shares or (0.0,) * self.n_level):  # zeros: automatic
            params.level_shares[level] = share
        params.t1 = self.t1
        params.t2 = self.t2
        params.skip_cached = self.skip_cached
        params.t_mid = self.t_mid if self.t_mid is not None else (self.t1 + self.t2) / 2
        params.hit_policy = HIT_POLICIES.index(self.hits)
        params.warm_low = self.warm
        params.mode = MODES.index(self.mode)
        params.page_cache_room_bytes = page_cache_room_bytes
        if placement is not None:
            keep.append(ffi.new("int8_t[]", [x for row in placement for x in row]))
            params.expert_levels = keep[-1]
            params.n_expert_levels = len(keep[-1])
        if self.popularity is not None:
            keep.append(ffi.new("float[]", [x for row in self.popularity for x in row]))
            params.expert_popularity = keep[-1]
            params.n_expert_popularity = len(keep[-1])
        return params, keep


def _scalar_hints() -> dict:
    """The fields that hold a number or a boolean (or None), by their type hints."""
    def scalar(hint) -> bool:
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            return all(scalar(a) for a in typing.get_args(hint))
        return hint in (float, int, bool, type(None))
    return {name: hint for name, hint in typing.get_type_hints(OffloadConfig).items() if scalar(hint)}


_SCALAR_HINTS = _scalar_hints()
