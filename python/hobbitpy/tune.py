"""``hobbitpy tune``: the precision ladder, the budget split and the hit policy for a memory
size and a quality budget, measured rather than guessed.

1. The expert budget that memory leaves (the same planner `run` uses, for a process
   capped at that size).
2. Candidate ladders, high to low: one level (the model's own experts, or the experts of
   a smaller quant: a ggml type written by `prepare`, or a llama.cpp mix such as Q3_K_M
   made by its quantizer), or two levels (a low copy under a higher one), each level
   holding only copies cheaper than the model's own, or two levels placed statically: one
   copy of every expert, the most weighed by the routers high (placement.py), weighed on
   the text past the tokens scored (unscored_text()), also with T2's skip on their resident
   experts (skip_cached). Files missing are made first (never overwriting).
3. Each candidate is scored on the text token by token at that budget, with the hit
   behaviour it will really have (`hits` upgrade or found, warm-up, the cache churning):
   perplexity, KL and top-1 against stock on the model; and the runtime's counters give
   its cost per token: the expert bytes its matmuls stream, the bytes it loaded in the
   background, and the bytes it waited for from the disk weighted by the ratio of memory
   to disk bandwidth (a fixed ratio, so the choice depends on the model, the text and the
   budget only: it is deterministic).
4. The cheapest candidate within the perplexity budget becomes the profile next to the
   model, which `run` and `hobbitpy.Llama` apply by themselves. "Within" means with 95 %
   confidence (one-sided) given the tokens scored: the per-token likelihood differences
   give the measured increase a standard error, and a candidate's upper bound must meet
   the budget; only when none does, the choice falls to the candidate closest to the model
   (the lowest mean KL) among those measured within (with a note to score more tokens).
   Measured on 1024 tokens of the inflated ref-deepseek: Q3_K +0.48 % with a bound of
   +1.46 % (and +1.10 % on other text), Q3_K_M +0.53 % and +1.25 %: a confident choice
   within 1 % there needs several thousand tokens, and neither the cheapest measured within
   nor the lowest bound is a safe one (choose()).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import math
import os

from gguf import GGMLQuantizationType as QT

from ._ggml import lib as ggml
from .config import MB, OffloadConfig
from .errors import HobbitError
from .evaluate import Reference, evaluate_against, tokenize_text
from .memory import ContextShape, context_sizes, fit_ubatch, plan_offload, process_resident_bytes
from .model_file import ModelInfo, inspect_model
from .presets import preset_settings
from .profile import Profile
from .quants import BASE_TYPES

# memory streams expert weights to the matmuls about this many times faster than the disk
# delivers a missed expert (O_DIRECT reads plus the copy into the slot; this machine: 1-1.7
# GB/s against 12-20 GB/s)
MEMORY_OVER_DISK = 10.0

# one-sided 95 % quantile of the normal: a candidate's perplexity increase is taken at its
# measured value plus this many standard errors
CONFIDENCE_Z = 1.645

# a placed ladder's importance is traced on at least this much text past the scored tokens
MIN_PLACEMENT_TOKENS = 256

# levels tune considers, high to low; plain ggml types are `prepare` companions, mixes are
# llama.cpp's uniform quants (their down projections a step higher)
SINGLE_LEVELS = ("Q6_K", "Q4_K_M", "Q4_K", "Q3_K_M", "Q3_K", "Q2_K")
TWO_LEVELS = (("Q4_K_M", "Q2_K"), ("Q4_K", "Q2_K"), ("Q3_K_M", "Q2_K"), ("Q4_K_M", "Q3_K"), (None, "Q2_K"))
# ladders placed statically by importance (placement.py): a copy of every expert, each at one level
# (IQ2_XXS: 2.06 bits a weight, a fifth less than Q2_K; made only with the model's importance
# matrix, `hobbitpy imatrix`, found next to it)
PLACED_LEVELS = (("Q3_K", "Q2_K"), ("Q3_K_M", "Q2_K"), ("Q4_K", "Q2_K"), ("Q4_K_M", "Q3_K"), ("Q4_K", "IQ2_XXS"))
# the presets (presets.py) tune scores as they are, each paper's method at the budget: Fiddler's
# needs a profile of calibration text, which tune does not trace
PRESET_CANDIDATES = ("lru", "importance", "fate", "hobbit", "corm")


@dataclass
class Candidate:
    name: str
    settings: dict  # OffloadConfig fields (high, low, hits)
    placed: bool = False  # the experts placed by their importance on the text (a trace of it)


def candidates() -> list[Candidate]:
    out = [Candidate("model", {})]
    out += [Candidate(high, {"high": high}) for high in SINGLE_LEVELS]
    for high, low in TWO_LEVELS:
        name = f"{high or 'model'}/{low}"
        for hits in ("upgrade", "found"):
            out.append(Candidate(f"{name} {hits}", {"high": high, "low": low, "hits": hits}))
    out += [Candidate(f"{high}/{low} placed", {"high": high, "low": low, "hits": "found"}, placed=True)
            for high, low in PLACED_LEVELS]
    # ... with T2's skip on resident experts too: every expert of a placed ladder is resident,
    # and a token's compute is what a skip saves (at the default T2 a tenth of the selections,
    # within the standard error of the perplexity measured on ref-mixtral: docs/BENCHMARKS.md)
    out += [Candidate(f"{high}/{low} placed skip", {"high": high, "low": low, "hits": "found", "skip_cached": True},
                      placed=True) for high, low in PLACED_LEVELS]
    out += [Candidate(f"preset {name}", preset_settings(name)) for name in PRESET_CANDIDATES]
    return out


def check_candidate_names(names: list[str]) -> None:
    """Raises ValueError naming the first name no candidate has (a typo must not silently
    leave a candidate out)."""
    known = [c.name for c in candidates()]
    for name in names:
        if name not in known:
            raise ValueError(f"no tune candidate is named {name!r}; the candidates are: {', '.join(known)}")


def importance_on_text(model: str, text: str, n_ctx: int, threads: int) -> tuple[tuple[float, ...], ...]:
    """How much the routers weigh each expert on the text (a trace of prompts cut from it),
    rounded to 6 significant digits: what a placed candidate's profile keeps."""
    from .calibrate import prompts_from_text
    from .placement import expert_importance
    from .trace import record_trace

    try:
        prompts = prompts_from_text(text)
    except ValueError as e:
        raise HobbitError(f"the experts cannot be placed by the text past the scored tokens: {e}") from None
    trace = record_trace(model, prompts, n_predict=32, n_ctx=n_ctx, n_threads=threads)
    return tuple(tuple(float(f"{x:.6g}") for x in row) for row in expert_importance(trace).tolist())


def unscored_text(model: str, text: str, n_scored: int) -> str:
    """The text past its first n_scored tokens, the ones tune scores. A placed ladder's experts
    are placed by this part: placed by the scored tokens themselves, a ladder is scored on the
    text it was fitted to and its increase reads low (ref-mixtral at 0.55, placed and scored on
    one text: bound +1.00 % there, +1.11 % on held-out text). Raises HobbitError when fewer than
    MIN_PLACEMENT_TOKENS remain."""
    from .tokens import Vocabulary

    with Vocabulary(model) as vocab:
        rest = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)[n_scored:]
        if len(rest) < MIN_PLACEMENT_TOKENS:
            raise HobbitError(f"placing the experts needs {MIN_PLACEMENT_TOKENS} tokens of text past the {n_scored} "
                              f"scored, the text has {len(rest)}: give a longer --text or fewer --max-tokens")
        return vocab.detokenize(rest).decode("utf-8", errors="replace")


def _level_file(model: str, spec: str, threads: int, log) -> str:
    """The file of a level, made first when missing (a `prepare` companion, quantized with the
    model's importance matrix when `hobbitpy imatrix` wrote one next to it, or a uniform quant)."""
    from .companions import resolve_level
    from .errors import ModelFileError
    from .imatrix import default_imatrix_path
    from .prepare import companion_type, default_companion_path, needs_imatrix, prepare_companion
    from .quants import default_quant_dir, is_mix_name, make_uniform_quant

    try:
        return resolve_level(model, spec, "--high")
    except ModelFileError:
        pass
    if is_mix_name(spec):
        path, _ = make_uniform_quant(model, spec, default_quant_dir(model), threads)
    else:
        matrix = default_imatrix_path(model)
        if needs_imatrix(companion_type(spec, with_imatrix=True)) and not matrix.is_file():
            raise ModelFileError(f"{spec} copies need the model's importance matrix; make it with: "
                                 f"hobbitpy imatrix {model} --text FILE (then {matrix} is used)")
        path = prepare_companion(model, spec, default_companion_path(model, spec), threads=threads, progress=False,
                                 imatrix_path=matrix if matrix.is_file() else None)
    log(f"made {path}")
    return str(path)


def _can_be_smaller(info: ModelInfo, spec: str) -> bool:
    """Whether a level of this type or mix can hold the model's experts in fewer bytes: its
    (base) type must spend fewer bits a weight than the model's experts do. Decided before a
    file is made (at real size, a copy made for nothing costs minutes and gigabytes)."""
    name = BASE_TYPES.get(spec.upper(), spec.upper())
    if name not in QT.__members__:
        return True  # an unknown name fails later, with its own message
    qtype = QT[name]
    bits = 8 * ggml.ggml_type_size(qtype) / ggml.ggml_blck_size(qtype)
    n_weights = info.n_layer_moe * info.n_expert * 3 * info.n_embd * info.n_ff_expert
    return n_weights == 0 or bits < 8 * info.expert_bytes_total / n_weights


def expert_budget(info: ModelInfo, available_bytes: int | None, shape: ContextShape, levels: tuple[ModelInfo, ...],
                  config: OffloadConfig) -> int | None:
    """The budget `run` would plan with available_bytes left to it (None: the memory available
    now), for these levels; None when it would not offload at all."""
    if shape.n_ubatch is None:  # as a run would choose it
        shape = dataclasses.replace(shape, n_ubatch=fit_ubatch(info, shape, config, levels, available_bytes))
    plan = plan_offload(info, config, context_sizes(info, shape).total, levels, available_bytes=available_bytes)
    return plan.budget_bytes


def tune(model: str, text: str, *, memory_bytes: int | None, max_ppl_increase: float = 0.01,
         max_tokens: int = 2048, run_shape: ContextShape = ContextShape(), n_ctx: int = 256,
         threads: int | None = None, log=print, names: list[str] | None = None,
         process_bytes: int | None = None, reference: Reference | None = None) -> tuple[Profile, list[dict]]:
    """Measure every candidate (or those named) and return the profile of the cheapest within
    the budget, and every measurement. run_shape: the context the runs will have (their buffers
    come out of the memory); n_ctx: the scoring windows; process_bytes: what a run's process
    holds before it loads a model (default: this process now, before the reference; a caller
    that has loaded models already measures it before); reference: stock on the text, when the
    caller has measured it already (tuning for several memories). Raises HobbitError if none is
    within it."""
    base = process_resident_bytes() if process_bytes is None else process_bytes
    available = None if memory_bytes is None else memory_bytes - base
    threads = threads or os.cpu_count() or 1
    info = inspect_model(model)
    if not info.is_moe:
        raise HobbitError(f"{model} is a dense model: there are no experts to tune")
    if reference is None:
        reference = Reference.measure(model, tokenize_text(model, text, max_tokens), n_ctx=n_ctx, n_threads=threads)
        log(f"reference: stock on {model}, {len(reference.ids)} tokens, perplexity {reference.perplexity:.4f}")
    ids = reference.ids
    rows = []
    chosen = [cand for cand in candidates() if names is None or cand.name in names]
    importance, unplaced = None, ""  # traced once for every placed candidate, or why not
    if any(cand.placed for cand in chosen):
        try:
            importance = importance_on_text(model, unscored_text(model, text, len(ids)), n_ctx, threads)
            log(f"  expert importance traced on the text past the scored tokens ({len(importance)} MoE layers)")
        except HobbitError as e:
            unplaced = str(e)
    width = max((len(cand.name) for cand in chosen), default=0)  # one column for the longest name ("... placed skip")
    for cand in chosen:
        settings = {k: v for k, v in cand.settings.items() if v is not None}
        if cand.placed:
            if importance is None:
                log(f"  {cand.name:<{width}} skipped: {unplaced}")
                continue
            settings["importance"] = importance
        larger = [settings[k] for k in ("high", "low") if k in settings and not _can_be_smaller(info, settings[k])]
        if larger:  # not made, not scored
            log(f"  {cand.name:<{width}} skipped: a {larger[0]} copy is no smaller than the model's experts")
            continue
        try:
            files = {k: _level_file(model, settings[k], threads, log) for k in ("high", "low") if k in settings}
        except (HobbitError, ValueError, OSError) as e:
            log(f"  {cand.name:<{width}} skipped: {e}")
            continue
        levels = (inspect_model(files["high"]) if "high" in files else info,) + (
            (inspect_model(files["low"]),) if "low" in files else ())
        # only copies cheaper than the model's own experts
        if any(level is not info and level.expert_bytes_total >= info.expert_bytes_total for level in levels):
            continue
        config = OffloadConfig(**settings)
        try:
            budget = expert_budget(info, available, run_shape, levels, config)
        except HobbitError as e:
            log(f"  {cand.name:<{width}} does not fit: {e}")
            continue
        if budget is None:
            budget = info.expert_bytes_total  # everything fits: stock would keep it all resident
        r = evaluate_against(model, reference, OffloadConfig(**settings, cache_mb=budget / MB), n_ubatch=1,
                             n_threads=threads)
        cost = _cost(r.stats, levels, info, r.n_tokens, predicts_neurons=config.neurons is not None)
        row = {"name": cand.name, "settings": settings, "budget_mb": budget / MB, "perplexity": r.perplexity,
               "ppl_increase": r.perplexity / reference.perplexity - 1.0,
               "ppl_increase_upper": math.exp(math.log(r.perplexity / reference.perplexity)
                                              + CONFIDENCE_Z * (r.log_ppl_ratio_se or 0.0)) - 1.0,
               "mean_kl": r.mean_kl,
               "top1_agreement": r.top1_agreement, "cost": cost}
        rows.append(row)
        log(f"  {cand.name:<{width}} budget {budget / MB:7.1f} MB  ppl {100 * row['ppl_increase']:+6.2f} % "
            f"(95 % bound {100 * row['ppl_increase_upper']:+6.2f} %)  KL {row['mean_kl']:.4f}  "
            f"cost {row['cost']:.3g} MB/token")
    best = choose(rows, max_ppl_increase, len(ids), log)
    if best is None:
        raise HobbitError(f"{model}: no candidate stays within {100 * max_ppl_increase:g} % perplexity at this memory "
                          f"(best: {min(rows, key=lambda r: r['ppl_increase'])['name'] if rows else 'none fits'})")
    profile = Profile(model=os.path.basename(model), model_bytes=os.path.getsize(model), settings=best["settings"],
                      calibration={"tool": "tune", "memory_mb": None if memory_bytes is None else memory_bytes / MB,
                                   "run_context": run_shape.n_ctx,
                                   "max_ppl_increase": max_ppl_increase, "n_tokens": len(ids),
                                   "reference_perplexity": reference.perplexity, "chosen": best["name"],
                                   "candidates": rows})
    return profile, rows


def choose(rows: list[dict], max_ppl_increase: float, n_tokens: int, log=print) -> dict | None:
    """The cheapest candidate within the budget with 95 % confidence. When none is, the text
    scored was too short to tell the candidates apart from the budget: of those whose measured
    increase is within, the one closest to the model (the lowest mean KL), not the cheapest nor
    the lowest bound. The perplexity difference sums per-token log-ratios of both signs and
    scatters; KL is never negative and ranks the candidates more steadily: on ref-deepseek
    (1024 tokens) the cheapest within (+0.48 %) was +1.10 % on other text, the lowest bound
    (+0.23 %, bound +1.09 %) +1.42 %, the lowest KL (+0.53 %) +0.47 %. None when no measured
    increase is within."""
    confident = [r for r in rows if r["ppl_increase_upper"] <= max_ppl_increase]
    if confident:
        return min(confident, key=lambda r: (r["cost"], r["ppl_increase"], r["name"]))
    measured = [r for r in rows if r["ppl_increase"] <= max_ppl_increase]
    if not measured:
        return None
    log(f"  no candidate is within {100 * max_ppl_increase:g} % with 95 % confidence on {n_tokens} tokens: "
        "choosing the one closest to the model (the lowest KL; score more tokens for a cheaper choice)")
    return min(measured, key=lambda r: (r["mean_kl"], r["cost"], r["name"]))


def _cost(stats: dict | None, levels: tuple[ModelInfo, ...], info: ModelInfo, n_tokens: int,
          predicts_neurons: bool = False) -> float:
    """Expert megabytes per token: what the matmuls stream (with CORM's neuron prediction, each
    selection past the first MoE layer streams its gate projection, a third of it, once more:
    experts are multiplied whole), plus what loaded in the background (warm-up, upgrades: each a
    copy into a slot that competes with the matmuls for the cores), plus MEMORY_OVER_DISK times
    what decoding waited for from the disk."""
    if stats is None:  # stock: every expert resident (the budget held them all)
        return info.expert_bytes_total / info.n_expert * info.n_expert_used / MB
    per_expert = [level.expert_bytes_total / (level.n_layer_moe * level.n_expert) for level in levels]
    served = sum(n * b for n, b in zip(stats["served"], per_expert))
    if predicts_neurons:
        served *= 1.0 + (info.n_layer_moe - 1) / info.n_layer_moe / 3.0
    waited = stats["demand_bytes_read"]
    return (served + stats["background_bytes_read"] + MEMORY_OVER_DISK * waited) / max(1, n_tokens) / MB
