"""``hobbitpy tune``: the precision ladder, the budget split and the hit policy for a memory
size and a quality budget, measured rather than guessed, in minutes at any model size.

1. One pass over the text with the model's own experts, exact (the logits stock llama.cpp
   gives, at any budget), in batches and within the memory tuned for: the reference's
   next-token log-probabilities on the scored tokens, and the routing of every token, of the
   text past them too (ROUTED_TOKENS), which placed candidates are placed by (scoring a
   ladder on the text it was placed by reads low: ref-mixtral at 0.55, bound +1.00 % there,
   +1.11 % on held-out text).
2. Candidate ladders, high to low: one level (the model's own experts, or the experts of a
   smaller quant: a ggml type written by `prepare`, or a llama.cpp mix such as Q3_K_M made by
   its quantizer), two levels (a low copy under a higher one; upgrade or found hits), two
   levels placed statically by the routers' weight on the text, times what each expert loses
   at the low copy where the default's kept calibration priced it (placement.expected_error:
   the default's order), also with T2's skip on
   their resident experts, HOBBIT's dynamic precision as the default serves it (scored as
   the default measures it: static, every selection at the level its score wants), and the
   presets. Only copies cheaper than the model's own.
3. Each priced at the expert budget `run` would plan for that memory (candidate_cost.py): a
   static candidate, whose outputs do not depend on what its cache holds nor on how tokens
   are batched (one level; a placed ladder), from the routing of the scored tokens replayed
   token by token through the runtime's own expert cache with the policy a run would give
   it, before it runs (modelled while a level's file is still to be made, replayed once it
   is made); a dynamic one by the
   runtime's counters as it decodes, with only its floor known before.
4. Scored cheapest first, against the reference: perplexity, KL, top-1. A static candidate in
   batches (prefill speed: its outputs are those of decoding); a dynamic one token by token,
   as it decodes, on the first DYNAMIC_SHARE of the tokens. Files a candidate needs are made
   just before it is scored. Once one is within the limit, a candidate that costs more is not
   scored: it could not be chosen. The time limit stops the scoring where it is, and says
   what was left.
5. The cheapest candidate within the limit, a mean KL from the model's own next-token
   distributions (MAX_MEAN_KL by default, the default ladder's own), becomes the profile
   next to the model, which `run` and `hobbitpy.Llama` apply by themselves (choose());
   perplexity, its one-sided 95 % bound and top-1 agreement are reported beside.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import math
import os
import pathlib
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..binding.ggml import block_size, type_size
from ..analysis.candidate_cost import floor_cost, measured_cost, modeled_cost, replayed_cost, routing_trace
from ..copies.companions import (companion_type, copy_layer_bytes, default_companion_path, estimated_copy,
                                 needs_imatrix, resolve_level)
from ..settings.config import DEFAULT_T2, MAX_MEAN_KL, MB, OffloadConfig
from ..errors import BudgetError, HobbitError, ModelFileError
from .evaluate import REFERENCE_UBATCH, evaluate_against
from ..copies.imatrix import default_imatrix_path
from ..analysis.likelihood import Reference, ReferenceTable, scoring_bytes, scoring_windows
from ..runtime.default_ladder import (DYNAMIC_PREFETCH_LAYERS, DYNAMIC_THRESHOLDS, LOW_TYPE, dynamic_settings,
                                      kept_prior, kept_rounding_error, with_kept_prior)
from ..runtime.llama import Llama
from ..plan.memory import (ContextShape, available_memory_bytes, context_sizes, fit_ubatch, plan_offload,
                           process_resident_bytes, whole_memory_budget_mb)
from ..files.model_file import ModelInfo, inspect_model, layer_expert_bytes
from ..system.outputs import NotEnoughSpaceError, check_free_space
from ..plan.placement import expected_error, importance_of, place_by_importance
from ..copies.prepare import prepare_companion
from ..settings.presets import preset_settings
from ..plan.profile import Profile
from ..system.progress import progress_bar
from ..copies.quants import (BASE_TYPES, default_quant_dir, is_mix_name, make_uniform_quant, quant_path,
                             source_record_path)
from ..files.tokens import tokenize_text
from ..files.trace_file import Trace

# one-sided 95 % quantile of the normal: a candidate's perplexity increase is taken at its
# measured value plus this many standard errors
CONFIDENCE_Z = 1.645

# placed ladders are placed by at least this many tokens of the text past the scored ones, and
# by at most ROUTED_TOKENS of them
MIN_PLACEMENT_TOKENS = 256
ROUTED_TOKENS = 1024

# the pass over the text scores at least this many windows, more while it has taken less than
# PASS_SHARE of the time limit
MIN_SCORED_WINDOWS = 2
PASS_SHARE = 0.3

# a dynamic candidate decodes token by token (at real size about a token a second here): it
# is scored on this share of the scored windows, at least one
DYNAMIC_SHARE = 0.25
# a token decoded alone takes about this many times its share of a batched pass (17 GB model
# under 12 GiB: 0.84 s a token decoding, 0.10 s a token in passes of 256), to tell whether a
# dynamic candidate can be scored in the time left
DECODE_OVER_BATCHED = 8.0

# the windows the text is scored in (tokens of context each)
SCORING_CTX = 256

# how fast the files of levels are made (bytes of the model read a second, on this 2-core
# machine: `prepare` made a 17 GB model's Q2_K copy in 4.3 minutes, llama.cpp's quantizer its
# uniform Q2_K in 12), to leave a candidate whose files would not be ready within the time left
PREPARE_BYTES_PER_S = 60e6
QUANTIZE_BYTES_PER_S = 24e6

# how long tune scores by default, in minutes
TIME_LIMIT_MINUTES = 15.0

# levels tune considers, high to low; plain ggml types are `prepare` companions, mixes are
# llama.cpp's uniform quants (their down projections a step higher)
SINGLE_LEVELS = ("Q6_K", "Q4_K_M", "Q4_K", "Q3_K_M", "Q3_K", "Q2_K")
TWO_LEVELS = (("Q4_K_M", "Q2_K"), ("Q4_K", "Q2_K"), ("Q3_K_M", "Q2_K"), ("Q4_K_M", "Q3_K"), (None, "Q2_K"))
# ladders placed statically by importance (placement.py): a copy of every expert, each at one level
# (IQ2_XXS: 2.06 bits a weight, a fifth less than Q2_K; made only with the model's importance
# matrix, `hobbitpy imatrix`, found next to it)
# (None: the model's own experts high, the default's ladder where memory holds it, default_ladder.py)
PLACED_LEVELS = ((None, "Q2_K"), ("Q3_K", "Q2_K"), ("Q3_K_M", "Q2_K"), ("Q4_K", "Q2_K"), ("Q4_K_M", "Q3_K"),
                 ("Q4_K", "IQ2_XXS"))
# the presets (presets.py) tune scores as they are, each paper's method at the budget: Fiddler's
# needs a profile of calibration text, which tune does not trace
PRESET_CANDIDATES = ("lru", "importance", "fate", "hobbit", "corm")


@dataclass
class Candidate:
    name: str
    settings: dict  # OffloadConfig fields (high, low, hits)
    placed: bool = False  # the experts placed by their importance on the text (a trace of it)
    # the settings its quality is measured with where they differ from those served (dynamic
    # precision as the default measures it: what it serves, or worse)
    scored: dict | None = None


def candidates() -> list[Candidate]:
    out = [Candidate("model", {})]
    out += [Candidate(high, {"high": high}) for high in SINGLE_LEVELS]
    for high, low in TWO_LEVELS:
        name = f"{high or 'model'}/{low}"
        for hits in ("upgrade", "found"):
            out.append(Candidate(f"{name} {hits}", {"high": high, "low": low, "hits": hits}))
    # HOBBIT's dynamic precision as the default serves it where its ladders are beyond the limit, at
    # each of the thresholds it searches (default_ladder.py), through the cache it serves it with; scored as
    # the default measures it: every selection its rule sends low served low and every one it skips
    # skipped, whatever the cache holds (static: in batches, where decoding it costs minutes at real size)
    for t1, t2 in DYNAMIC_THRESHOLDS:
        out.append(Candidate(f"model/{LOW_TYPE} dynamic T1 {t1:g}" + ("" if t2 >= 1.0 else f" T2 {t2:g}"),
                             {"low": LOW_TYPE, **dynamic_settings(t1, t2), "prefetch_layers": DYNAMIC_PREFETCH_LAYERS},
                             scored={"low": LOW_TYPE, **dynamic_settings(t1, t2, priced=True)}))
    out += [Candidate(f"{high or 'model'}/{low} placed", {"high": high, "low": low, "hits": "found"}, placed=True)
            for high, low in PLACED_LEVELS]
    # ... with T2's skip on resident experts too: every expert of a placed ladder is resident,
    # and a token's compute is what a skip saves (at the default T2 a tenth of the selections,
    # within the standard error of the perplexity measured on ref-mixtral: docs/BENCHMARKS.md at 5f63b2a)
    out += [Candidate(f"{high or 'model'}/{low} placed skip",
                      {"high": high, "low": low, "hits": "found", "skip_cached": True}, placed=True)
            for high, low in PLACED_LEVELS]
    out += [Candidate(f"preset {name}", preset_settings(name)) for name in PRESET_CANDIDATES]
    return out


def check_candidate_names(names: list[str]) -> None:
    """Raises ValueError naming the first name no candidate has (a typo must not silently
    leave a candidate out)."""
    known = [c.name for c in candidates()]
    for name in names:
        if name not in known:
            raise ValueError(f"no tune candidate is named {name!r}; the candidates are: {', '.join(known)}")


def quality_is_static(settings: dict) -> bool:
    """Whether a candidate's outputs are the same whatever its cache holds and however its tokens
    are batched: one level (a miss is read at the same precision), or a placed ladder (each
    expert has one copy, at the level placed), without the rules that decide per token and
    pass (T2's skip of resident experts, substitution, neuron masks, a prompt's low share); or
    levels chosen by the scorer alone: each selection served at the level its score wants
    (`--hits exact`), and skipped by T2 cached or not (`--skip-cached`) or never."""
    if any(settings.get(k) for k in ("substitute_alpha", "neurons", "prefill_low_share")):
        return False
    if "low" not in settings or settings.get("importance") is not None:
        return not settings.get("skip_cached")
    return settings.get("hits") == "exact" and (bool(settings.get("skip_cached"))
                                                 or settings.get("t2", DEFAULT_T2) >= 1.0)


@dataclass
class TextPass:
    """What one exact pass over the tuning text gives every candidate."""
    reference: Reference
    scored: Trace                        # the routing of the scored tokens, as decoding meets them
    importance: np.ndarray | None        # [moe_layers, n_expert] on the text past them, or None ...
    unplaced: str = ""                   # ... and why not
    seconds_per_window: float = 0.0      # what a scored window's pass took


def measure_text(model: str, text: str, max_tokens: int, n_ctx: int, available: int | None,
                 threads: int, log=print, seconds: float | None = None) -> TextPass:
    """The routing of up to ROUTED_TOKENS past the first max_tokens of the text (what placed
    candidates are placed by), then the reference and the routing on windows of n_ctx of those
    first tokens; each window one pass of the model's own experts through the runtime, exact,
    with as much cache as the memory (available; None: now) leaves beside the scoring's arrays.
    seconds: past this long no further window is scored (at least MIN_SCORED_WINDOWS are)."""
    started = time.monotonic()
    info = inspect_model(model)
    every = tokenize_text(model, text)
    ids, rest = every[:max_tokens], every[max_tokens:][:ROUTED_TOKENS]
    shape = ContextShape(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True)
    held = scoring_bytes(n_ctx, info.n_vocab)
    cache_mb = whole_memory_budget_mb(info, shape, (available_memory_bytes() if available is None else available) - held)
    windows = [window for window, _ in scoring_windows(ids, n_ctx)]
    placing = [rest[s: s + n_ctx] for s in range(0, len(rest), n_ctx)] if len(rest) >= MIN_PLACEMENT_TOKENS else []
    experts, weights = [], []
    bar = progress_bar(total=len(placing) + len(windows), desc="reference", unit="pass", leave=False)
    with Llama(model, offload=OffloadConfig(cache_mb=cache_mb, auto=False), n_ctx=n_ctx, n_batch=n_ctx,
               n_ubatch=n_ctx, logits_all=True, n_threads=threads, verbose=False) as llm, bar:
        importance, unplaced = None, (f"placing the experts needs {MIN_PLACEMENT_TOKENS} tokens of text past the "
                                      f"{len(ids)} scored, the text has {len(rest)}: give a longer --text or fewer "
                                      "--max-tokens")
        if placing:
            routing = llm.record_routing(placing, after_prompt=lambda i: bar.update())
            importance, unplaced = importance_of(routing.experts, routing.weights, info.n_expert), ""
        table = ReferenceTable(ids, n_ctx, llm.n_vocab())
        scoring = time.monotonic()
        try:
            for window in windows:
                if seconds is not None and len(experts) >= MIN_SCORED_WINDOWS and time.monotonic() - started > seconds:
                    break
                routing = llm.record_routing([window], after_prompt=lambda i: table.add(
                    np.array(llm.scores[: len(window)], dtype=np.float32)))
                experts.append(routing.experts)
                weights.append(routing.weights)
                bar.update()
            reference = table.finish()
        except BaseException:
            table.close()
            raise
    per_window = (time.monotonic() - scoring) / len(experts)
    scored = routing_trace(np.concatenate(experts), np.concatenate(weights), info)
    elapsed = time.monotonic() - started
    short = (f", of {len(ids)}: the time the limit leaves the pass has passed" if len(reference.ids) < len(ids)
             else "")
    log(f"reference: the model's own experts on {len(reference.ids)} tokens{short}, perplexity "
        f"{reference.perplexity:.4f}; routed {sum(len(w) for w in placing)} more to place by ({elapsed:.0f} s)")
    return TextPass(reference, scored, importance, unplaced, per_window)


def _check_can_make(model: str, spec: str) -> None:
    """ModelFileError when a level cannot be made here (a type that needs the model's importance matrix, without it)."""
    if not is_mix_name(spec) and needs_imatrix(companion_type(spec, with_imatrix=True)) \
            and not default_imatrix_path(model).is_file():
        raise ModelFileError(f"{spec} copies need the model's importance matrix; make it with: "
                             f"hobbitpy imatrix {model} --text FILE (then {default_imatrix_path(model)} is used)")


def _level(model: str, info: ModelInfo, spec: str | None) -> tuple[ModelInfo, np.ndarray, bool]:
    """A level's file as inspect_model sees it, its expert bytes per MoE layer, and whether it
    exists; a file still to be made is estimated (a mix as its base type)."""
    if spec is None:
        return info, layer_expert_bytes(model), True
    try:
        path = resolve_level(model, spec, "--high")
        return inspect_model(path), layer_expert_bytes(path), True
    except ModelFileError:
        pass
    _check_can_make(model, spec)
    base = BASE_TYPES.get(spec.upper(), spec.upper())
    layer_bytes = copy_layer_bytes(info, base)
    if not layer_bytes.any():
        raise HobbitError(f"the experts' rows are not whole {base} blocks")
    path = (quant_path(model, spec, default_quant_dir(model)) if is_mix_name(spec)
            else default_companion_path(model, spec))
    return estimated_copy(info, layer_bytes, path), layer_bytes, False


def _files_bytes(info: ModelInfo, plan: _Plan, specs: list[str]) -> int:
    """About what the files of these levels take on disk: a companion holds the experts only,
    a uniform quant (a mix) the whole model, its other weights counted at the model's size."""
    return sum(plan.levels[plan.specs.index(spec)].expert_bytes_total
               + (info.file_bytes - info.expert_bytes_total if is_mix_name(spec) else 0) for spec in specs)


def _exists(model: str, spec: str) -> bool:
    try:
        resolve_level(model, spec, "--high")
        return True
    except ModelFileError:
        return False


def _make_level(model: str, spec: str, threads: int, log) -> pathlib.Path:
    """Make a level's file (a `prepare` companion, quantized with the model's importance matrix
    when `hobbitpy imatrix` wrote one next to it, or a uniform quant); its path."""
    if is_mix_name(spec):
        path, _ = make_uniform_quant(model, spec, default_quant_dir(model), threads)
    else:
        matrix = default_imatrix_path(model)
        path = prepare_companion(model, spec, default_companion_path(model, spec), threads=threads, progress=True,
                                 imatrix_path=matrix if matrix.is_file() else None)
    log(f"made {path}")
    return pathlib.Path(path)


def _remove_unpicked(model: str, made: list[pathlib.Path], picked: dict | None, log) -> None:
    """Remove the files tune made that the pick does not read (all of them without a pick): at
    real size each is gigabytes beside the model. A quants folder left empty goes too."""
    read = set()
    for spec in (v for k, v in (picked or {}).items() if k in ("high", "mid", "low") and v is not None):
        try:
            read.add(pathlib.Path(resolve_level(model, spec, "--high")).resolve())
        except ModelFileError:
            pass  # (a level the pick names that is not there: nothing of it to keep)
    for path in made:
        if path.resolve() not in read:
            path.unlink(missing_ok=True)
            source_record_path(path).unlink(missing_ok=True)  # (a quant's record of its source)
            log(f"removed {path} (made for a candidate not picked; --keep keeps such files)")
    folder = default_quant_dir(model)
    if any(path.parent == folder for path in made) and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def expert_budget(info: ModelInfo, available_bytes: int | None, shape: ContextShape, levels: tuple[ModelInfo, ...],
                  config: OffloadConfig) -> tuple[int | None, int]:
    """The budget `run` would plan with available_bytes left to it (None: the memory available
    now), for these levels (None when it would not offload at all), and the ubatch it plans for."""
    if shape.n_ubatch is None:  # as a run would choose it
        shape = dataclasses.replace(shape, n_ubatch=fit_ubatch(info, shape, config, levels, available_bytes))
    plan = plan_offload(info, config, context_sizes(info, shape).total, levels, available_bytes=available_bytes)
    return plan.budget_bytes, shape.n_ubatch


@dataclass
class _Plan:
    cand: Candidate
    settings: dict
    static: bool
    specs: tuple                # the level specs, high to low (None: the model's own experts)
    levels: tuple               # their ModelInfo (estimated while missing)
    layer_bytes: list
    missing: tuple              # specs whose files are still to be made
    budget: int
    ubatch: int
    cost: float                 # modelled (static), or the floor (dynamic)
    measured: dict              # the settings its quality is measured with (Candidate.scored, else settings)

    @property
    def at_floor(self) -> bool:
        """Whether its cost is only its floor: a dynamic candidate before it runs, and one scored as
        the default measures it while its copy is still to be made."""
        return not self.static or (self.cand.scored is not None and bool(self.missing))


class _OutOfTime(Exception):
    pass


def _until(deadline: float, items, desc: str):
    """The items, with a bar; _OutOfTime once the deadline has passed."""
    for item in progress_bar(items, desc=desc, unit="window", leave=False):
        if time.monotonic() > deadline:
            raise _OutOfTime
        yield item


def tune(model: str, text: str, *, memory_bytes: int | None, max_mean_kl: float = MAX_MEAN_KL,
         max_tokens: int = 2048, run_shape: ContextShape = ContextShape(), n_ctx: int = SCORING_CTX,
         threads: int | None = None, log=print, names: list[str] | None = None,
         process_bytes: int | None = None, measured: TextPass | None = None,
         time_limit_s: float | None = None, keep: bool = False) -> tuple[Profile, list[dict]]:
    """Score the candidates (or those named) cheapest first and return the profile of the
    cheapest whose next-token distributions stay within max_mean_kl nats (mean KL from the
    model's own, as the default's ladder is judged), and every measurement. run_shape: the context the runs will
    have (their buffers come out of the memory); n_ctx: the scoring windows; process_bytes: what
    a run's process holds before it loads a model (default: this process now); measured: the
    pass over the text, when the caller has made it already (tuning for several memories);
    time_limit_s: scoring stops there, the pass over the text and the files made included
    (default TIME_LIMIT_MINUTES); keep: the files made for candidates not picked are kept (by
    default they are removed, as they are when tune fails). Raises HobbitError if none is within
    the limit."""
    started = time.monotonic()
    time_limit_s = 60 * TIME_LIMIT_MINUTES if time_limit_s is None else time_limit_s
    deadline = started + time_limit_s
    base = process_resident_bytes() if process_bytes is None else process_bytes
    available = None if memory_bytes is None else memory_bytes - base
    if available is not None and available <= 0:  # said before any pass or file
        raise HobbitError(f"a memory of {memory_bytes / MB:.0f} MB is less than the {base / MB:.0f} MB a run's process "
                          "holds before it loads a model: nothing can fit")
    threads = threads or os.cpu_count() or 1
    info = inspect_model(model)
    if not info.is_moe:
        raise HobbitError(f"{model} is a dense model: there are no experts to tune")
    if measured is None:
        measured = measure_text(model, text, max_tokens, n_ctx, available, threads, log, PASS_SHARE * time_limit_s)
    reference = measured.reference
    chosen = [cand for cand in candidates() if names is None or cand.name in names]
    width = max((len(cand.name) for cand in chosen), default=0)  # one column for the longest name ("... placed skip")

    def say(name, what):
        log(f"  {name:<{width}} {what}")

    prior = kept_prior(info)  # the cache dynamic precision is served through, as the default serves it
    # a placed ladder raises experts in the default's order where it priced the low copy: the
    # routers' weight on the text times what each expert loses at the copy (placement.expected_error)
    rounding = kept_rounding_error(info)
    plans = []
    for cand in chosen:
        settings = {k: v for k, v in cand.settings.items() if v is not None}
        if cand.scored is not None:
            settings.update(prior)
        if cand.placed:
            if measured.importance is None:
                say(cand.name, f"skipped: {measured.unplaced}")
                continue
            error = rounding.get(settings["low"])
            order = measured.importance if error is None else expected_error(measured.importance, error)
            settings["importance"] = tuple(tuple(float(f"{x:.6g}") for x in row) for row in order.tolist())
        larger = [settings[k] for k in ("high", "low") if k in settings and not _can_be_smaller(info, settings[k])]
        if larger:  # not made, not scored
            say(cand.name, f"skipped: a {larger[0]} copy is no smaller than the model's experts")
            continue
        try:
            plan = _plan(model, info, cand, settings, available, run_shape, measured.scored)
        except _NotCheaper:
            continue
        except BudgetError as e:
            say(cand.name, f"does not fit: {e}")
            continue
        except (HobbitError, ValueError, OSError) as e:
            say(cand.name, f"skipped: {e}")
            continue
        plans.append(plan)

    made: list[pathlib.Path] = []  # the levels' files made here
    picked = None  # the settings of the pick, once made
    try:
        rows, best = [], None  # best: the cheapest candidate within the limit
        left = []  # the candidates not scored, and why

        def leave(plan, why):
            say(plan.cand.name, f"not scored: {why}")
            left.append({"name": plan.cand.name, "cost": plan.cost, "static": plan.static, "why": why})

        for plan in sorted(plans, key=lambda p: (p.cost, p.cand.name)):
            name = plan.cand.name
            if best is not None and plan.cost > best["cost"]:
                leave(plan, f"costs {'at least ' if plan.at_floor else ''}{plan.cost:.3g} MB/token, more than "
                            f"{best['name']} ({best['cost']:.3g}), within the limit")
                continue
            making = [spec for spec in plan.missing if not _exists(model, spec)]
            try:  # before anything of them is written: a full disk midway would leave nothing but the time lost
                check_free_space(pathlib.Path(model).parent, _files_bytes(info, plan, making),
                                 f"making {', '.join(making)}")
            except NotEnoughSpaceError as e:
                leave(plan, str(e))
                continue
            # the files to make, and a pass over the scored text (a static candidate's; a dynamic
            # one's stops where the time runs out)
            needs = sum(info.file_bytes / QUANTIZE_BYTES_PER_S if is_mix_name(spec) else
                        info.expert_bytes_total / PREPARE_BYTES_PER_S for spec in making)
            windows = len(reference.log_probs)
            if plan.settings:  # (the model's own experts are the reference: nothing to score)
                needs += measured.seconds_per_window * (windows if plan.static else
                                                         _dynamic_windows(windows) * DECODE_OVER_BATCHED)
            if time.monotonic() + needs > deadline:
                to_make = f" to make {', '.join(making)} and score" if making else ""
                leave(plan, f"the time limit ({time_limit_s / 60:g} min) leaves "
                            f"{max(0, deadline - time.monotonic()):.0f} s, it needs about {needs:.0f} s{to_make}")
                continue
            try:
                for spec in making:
                    made.append(_make_level(model, spec, threads, log))
                if plan.missing:  # the files as made: the plan again
                    plan = _plan(model, info, plan.cand, plan.settings, available, run_shape, measured.scored)
                    if best is not None and plan.cost > best["cost"]:  # (priced at its floor until then)
                        leave(plan, f"costs {plan.cost:.3g} MB/token, more than {best['name']} ({best['cost']:.3g}), "
                                    "within the limit")
                        continue
            except _NotCheaper:
                say(name, "skipped: as made, a level is no smaller than the model's experts")
                continue
            except (HobbitError, ValueError, OSError) as e:
                say(name, f"skipped: {e}")
                continue
            if plan.settings:  # (the model's own experts are the reference itself)
                say(name, f"scoring ({'in batches' if plan.static else 'token by token'}, "
                          f"{'' if plan.static else 'at least '}{plan.cost:.3g} MB/token) ...")
            try:
                row = _score(model, plan, reference, threads, deadline, info, max_mean_kl)
            except _OutOfTime:
                leave(plan, f"the time limit ({time_limit_s / 60:g} min) passed while it was scored")
                continue
            except (HobbitError, ValueError, OSError) as e:
                say(name, f"skipped: {e}")
                continue
            rows.append(row)
            say(name, f"budget {row['budget_mb']:7.1f} MB  KL {'>=' if row['at_least'] else ''}{row['mean_kl']:.4f}  "
                      f"ppl {100 * row['ppl_increase']:+6.2f} % (95 % bound {100 * row['ppl_increase_upper']:+6.2f} %)  "
                      f"top-1 {100 * row['top1_agreement']:.1f} %  {row['n_tokens']} tokens  "
                      f"cost {row['cost']:.3g} MB/token")
            if row["mean_kl"] <= max_mean_kl and (best is None or row["cost"] < best["cost"]):
                best = row
        log(f"  scored {len(rows)} of {len(plans)} candidates in {time.monotonic() - started:.0f} s")
        pick = choose(rows, max_mean_kl)
        if not rows and left:
            raise HobbitError(f"{model}: no candidate was scored: {left[0]['why']} (give more --time-limit)")
        if pick is None:
            closest = min(rows, key=lambda r: r["mean_kl"]) if rows else None
            raise HobbitError(f"{model}: no candidate stays within {max_mean_kl:g} nats of the model's next-token "
                              "distributions at this memory (" + (f"closest: {closest['name']}, "
                              f"{'at least ' if closest['at_least'] else ''}{closest['mean_kl']:.4g} nats)"
                                                 if closest else "none fits)"))
        memory_mb = None if memory_bytes is None else memory_bytes / MB
        profile = Profile(model=os.path.basename(model), model_bytes=os.path.getsize(model), settings=pick["settings"],
                          calibration={"tool": "tune", "memory_mb": memory_mb,
                                       "run_context": run_shape.n_ctx,
                                       "max_mean_kl": max_mean_kl, "n_tokens": len(reference.ids),
                                       "reference_perplexity": reference.perplexity, "chosen": pick["name"],
                                       "candidates": rows, "not_scored": left})
        picked = profile.settings
        return profile, rows
    finally:
        if not keep:
            _remove_unpicked(model, made, picked, log)


class _NotCheaper(Exception):
    """A level no cheaper than the model's own experts."""


def _plan(model: str, info: ModelInfo, cand: Candidate, settings: dict, available: int | None,
          run_shape: ContextShape, scored: Trace) -> _Plan:
    """A candidate priced at the budget a run would get, with its levels' files as they are (or
    estimated while missing). _NotCheaper for a copy no cheaper than the model's experts;
    BudgetError when it does not fit."""
    specs = (settings.get("high"),) + ((settings["low"],) if "low" in settings else ())
    found = [_level(model, info, spec) for spec in specs]
    levels, layer_bytes = tuple(f[0] for f in found), [f[1] for f in found]
    if any(level is not info and level.expert_bytes_total >= info.expert_bytes_total for level in levels):
        raise _NotCheaper
    # priced through the cache a run would serve it with: the model's own experts with no policy
    # chosen go through the kept calibration's LFU where the default has kept one (with_kept_prior;
    # on ref-mixtral-8x7b-hardened at half the experts' bytes LRU reads 1.3x its bytes a token)
    config, _ = with_kept_prior(info, OffloadConfig(**settings))
    budget, ubatch = expert_budget(info, available, run_shape, levels, config)
    if budget is None:
        budget = info.expert_bytes_total  # everything fits: stock would keep it all resident
    measured = settings if cand.scored is None else {k: v for k, v in cand.scored.items() if v is not None}
    static = quality_is_static(measured)
    placement = (place_by_importance(np.array(settings["importance"]), layer_bytes, budget)
                 if "importance" in settings else None)
    if not static or (cand.scored is not None and not all(f[2] for f in found)):
        cost = floor_cost(info, levels)
    elif all(f[2] for f in found):  # the files as they are: the runtime's cache replays the routing
        level_paths = tuple(None if spec is None else level.path for spec, level in zip(specs, levels))
        # (as served, its reads ahead aside: a replay serves what the trace selects)
        cost = replayed_cost(scored, info, levels, dataclasses.replace(config, prefetch_layers=0), budget, level_paths,
                             placement)
    else:
        cost = modeled_cost(scored, layer_bytes, placement, budget, config.cache_policy)
    return _Plan(cand, settings, static, specs, levels, layer_bytes,
                 tuple(spec for spec, f in zip(specs, found) if not f[2]), budget, ubatch, cost, measured)


def _dynamic_windows(n_windows: int) -> int:
    return max(1, math.ceil(DYNAMIC_SHARE * n_windows))


def _score(model: str, plan: _Plan, reference: Reference, threads: int, deadline: float, info: ModelInfo,
           max_mean_kl: float) -> dict:
    """A candidate's row: its quality against the reference and its cost per token. Its scoring
    stops once it is sure to end beyond max_mean_kl (then "at_least": its mean KL is the least the
    whole text would measure; only a candidate within the limit can be chosen)."""
    settings = plan.settings
    if not settings:  # the model's own experts: the reference itself (the runtime is exact)
        n = len(reference.ids) - 1
        return {"name": plan.cand.name, "settings": settings, "budget_mb": plan.budget / MB,
                "perplexity": reference.perplexity, "ppl_increase": 0.0, "ppl_increase_upper": 0.0, "mean_kl": 0.0,
                "top1_agreement": 1.0, "cost": plan.cost, "n_tokens": n, "scored": "exact", "at_least": False}
    config = OffloadConfig(**plan.measured, cache_mb=plan.budget / MB)
    if plan.static:
        against = reference
        ubatch = max(1, min(reference.n_ctx, plan.ubatch or REFERENCE_UBATCH))
    else:
        against = reference.first_windows(_dynamic_windows(len(reference.log_probs)))
        ubatch = 1
    r = evaluate_against(model, against, config, n_ubatch=ubatch, n_threads=threads,
                         progress=lambda pairs: _until(deadline, pairs, plan.cand.name), stop_beyond=max_mean_kl)
    cost = plan.cost if plan.static else measured_cost(r.stats, plan.levels, info, r.n_tokens,
                                                       predicts_neurons=config.neurons is not None)
    ratio = r.perplexity / r.reference_perplexity
    return {"name": plan.cand.name, "settings": settings, "budget_mb": plan.budget / MB, "perplexity": r.perplexity,
            "ppl_increase": ratio - 1.0,
            "ppl_increase_upper": math.exp(math.log(ratio) + CONFIDENCE_Z * (r.log_ppl_ratio_se or 0.0)) - 1.0,
            "mean_kl": r.mean_kl, "top1_agreement": r.top1_agreement, "cost": cost, "n_tokens": r.n_tokens,
            "scored": "batched" if plan.static else "token by token", "at_least": not r.complete}

def _can_be_smaller(info: ModelInfo, spec: str) -> bool:
    """Whether a level of this type or mix can hold the model's experts in fewer bytes: its
    (base) type must spend fewer bits a weight than the model's experts do. Decided before a
    file is made (at real size, a copy made for nothing costs minutes and gigabytes)."""
    name = BASE_TYPES.get(spec.upper(), spec.upper())
    if name not in QT.__members__:
        return True  # an unknown name fails later, with its own message
    qtype = QT[name]
    bits = 8 * type_size(qtype) / block_size(qtype)
    n_weights = info.n_layer_moe * info.n_expert * 3 * info.n_embd * info.n_ff_expert
    return n_weights == 0 or bits < 8 * info.expert_bytes_total / n_weights


def choose(rows: list[dict], max_mean_kl: float) -> dict | None:
    """The cheapest candidate whose mean KL from the model's next-token distributions is within
    max_mean_kl (ties: the closer, then by name); None when none is. Closeness is judged by
    divergence, as the default's ladder is: the perplexity difference sums per-token
    log-ratios of both signs and scatters (on ref-deepseek's 1024 tokens the cheapest candidate
    within +1 % was +1.10 % on other text, the one lowest in KL +0.47 %), and on a weak model
    quantization noise can even lower it; KL is never negative."""
    within = [r for r in rows if r["mean_kl"] <= max_mean_kl]
    return min(within, key=lambda r: (r["cost"], r["mean_kl"], r["name"])) if within else None


