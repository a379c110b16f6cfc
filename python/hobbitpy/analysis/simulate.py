"""Replay a routing trace through the runtime's cache, offline.

replay(): a run's recorded routing, ubatch by ubatch, through the very cache the runtime's
params make (hobbit_replay_trace: its plan, its pools and levels, its waves), every load
completing at once: the runtime's counters by construction.

The replay runs in libhobbit (hobbit_simulate_cache): the policy objects are the
runtime's own, so a simulated LRU is the deployed LRU. Belady's offline optimum (evict
the expert needed farthest in the future) is the bound every policy is compared to.
The cache is one pool of budget // expert_bytes slots shared by all MoE layers, as
the runtime builds it for a model whose MoE layers share one expert shape; or, with
per_layer, a pool per MoE layer with its own policy (the runtime's --shallow-layers, Fate's
arrangement), the slots dealt out as the runtime deals them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, asdict

import numpy as np

from ..binding import hobbit
from ..binding.native import ffi
from ..settings.config import DEFAULT_T1, MB, POLICIES as RUNTIME_POLICIES
from ..errors import HobbitError
from ..plan.placement import expert_popularity
from ..settings.presets import preset_settings
from .scores import selection_scores
from ..files.trace_file import Trace

POLICIES = RUNTIME_POLICIES + ("belady",)  # Belady needs the future: offline only


def replay(model_path: str, params, experts: np.ndarray, weights: np.ndarray, ubatch_start, seq_start) -> dict:
    """The counters (offload_stats()'s) of the runtime params describe (a struct hobbit_params)
    serving the routing of experts and weights ([tokens, moe_layers, k]) from a cold start, in
    the ubatches ubatch_start marks (1 at each one's first token; empty: a token each), the
    policies' sequence records reset where seq_start marks a new sequence."""
    experts = np.ascontiguousarray(experts, dtype=np.int32)
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if experts.ndim != 3 or weights.shape != experts.shape:
        raise ValueError(f"experts and weights must be [tokens, moe_layers, k] alike, got {experts.shape} and {weights.shape}")
    starts = np.ascontiguousarray(ubatch_start, dtype=np.uint8)
    sequences = np.ascontiguousarray(seq_start, dtype=np.uint8)
    for name, marks in (("ubatch_start", starts), ("seq_start", sequences)):
        if marks.size not in (0, experts.shape[0]):
            raise ValueError(f"{name} has {marks.size} entries for {experts.shape[0]} tokens")
    t = ffi.new("struct hobbit_replay_trace *")
    t.n_tokens, t.n_layer, t.n_expert_used = experts.shape
    t.n_expert = hobbit.inspect_model(model_path).n_expert
    t.experts = ffi.cast("const int32_t *", experts.ctypes.data)
    t.weights = ffi.cast("const float *", weights.ctypes.data)
    t.ubatch_start = ffi.cast("const uint8_t *", starts.ctypes.data) if starts.size else ffi.NULL
    t.seq_start = ffi.cast("const uint8_t *", sequences.ctypes.data) if sequences.size else ffi.NULL
    return hobbit.stats_as_dict(hobbit.replay_trace(model_path, params, t))
DEFAULT_POLICIES = ("lru", "lfu", "lhu", "fld", "arc", "popularity", "score", "frequency", "random", "belady")


@dataclass
class SimResult:
    policy: str
    budget_mb: float
    n_slot: int
    accesses: int
    hits: int
    misses: int
    bytes_read: int
    miss_penalty: float
    substituted: int = 0  # selections a cached expert of similar score served instead (substitute_alpha)
    prefetched: int = 0  # experts loaded ahead of their layer (prefetch_layers; their bytes are in bytes_read)
    prefetch_used: int = 0  # of those, selected before they were evicted

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"hit_ratio": self.hit_ratio}


def slots_for_budget(trace: Trace, budget_mb: float) -> int:
    if not trace.meta.get("uniform", True):
        raise HobbitError(f"{trace.meta['model']}: its MoE layers have experts of different shapes or types; "
                          "the simulator models one pool and handles uniform models only")
    n_slot = int(budget_mb * MB) // trace.meta["expert_bytes"]
    k = trace.meta["n_expert_used"]
    if n_slot < k:
        raise HobbitError(f"a budget of {budget_mb:g} MB holds {n_slot} experts of "
                          f"{trace.meta['expert_bytes'] / MB:.2f} MB; one token needs {k}")
    return n_slot


def slots_per_layer(trace: Trace, budget_mb: float, shallow_layers: int = 0) -> list[int]:
    """The slots of each MoE layer's pool, as the runtime deals a budget (libhobbit's
    pool_plan_deal_per_layer): every layer a token's top-k, the first shallow_layers whole
    while the budget lasts, then the others a slot each in turn."""
    slots_for_budget(trace, budget_mb)  # a uniform model, at least one token's top-k
    m = trace.meta
    try:
        return hobbit.pool_plan_per_layer(m["n_moe_layer"], m["expert_bytes"], m["n_expert_used"], m["n_expert"],
                                          int(budget_mb * MB), shallow_layers)
    except HobbitError as e:
        raise HobbitError(f"{budget_mb:g} MB: {e}") from None


def router_scores(trace: Trace) -> np.ndarray:
    """[tokens, layers, n_expert] the router's scores as probabilities: the trace's probs, or
    for gpt-oss (which routes on logits and softmaxes over its selection) their softmax."""
    probs = trace.probs.astype(np.float32)
    if trace.meta.get("arch") == "gpt-oss":
        probs = np.exp(probs - probs.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
    return np.ascontiguousarray(probs, dtype=np.float32)


def simulate(trace: Trace, budget_mb: float, policy: str, *, weights=(0.25, 0.25, 0.25, 0.25), seed: int = 0,
             high_precision: np.ndarray | None = None, low_miss_cost: float = 1.0, t1: float | None = None,
             substitute_alpha: float = 0.0, popularity: np.ndarray | None = None, prefetch_layers: int = 0,
             label: str | None = None, per_layer: bool = False, shallow_layers: int = 0,
             n_slot: int | None = None) -> SimResult:
    """Misses of `policy` on `trace` with a cache of `budget_mb`. A selection is wanted at
    high precision per high_precision, or (t1) when its eq. 2 score is at most t1; a
    low-precision miss costs low_miss_cost of a high one (HOBBIT's miss penalty).
    substitute_alpha: the runtime's substitution of low-score misses first (the importance
    preset; not for Belady, whose future is the trace as routed). popularity: the profile
    the popularity policy ranks by ([MoE layers, n_expert]); default the trace's own
    selection counts (a profile of the very text replayed: Fiddler's best case); the
    frequency policy's prior (default none).
    prefetch_layers: after each layer the next P layers' experts the trace's predictor guessed
    are loaded by the runtime's decode prefetch rule (pinned until their layer, one layer
    deeper only while all are cached; not for Belady). label: the name the
    result goes by (default the policy). per_layer: a pool per MoE layer (slots_per_layer,
    shallow_layers whole first), each layer replayed alone with its own policy; not with
    prefetch, which loads into the next layers' pools. n_slot: the slots themselves, for a
    budget that is not a whole number of experts (per_layer's pools)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if high_precision is None and t1 is not None:
        high_precision = selection_scores(trace.weights) <= t1
    if per_layer:
        return _simulate_per_layer(trace, budget_mb, policy, shallow_layers, label=label, weights=weights, seed=seed,
                                   high_precision=high_precision, low_miss_cost=low_miss_cost,
                                   substitute_alpha=substitute_alpha, popularity=popularity,
                                   prefetch_layers=prefetch_layers)
    native_policy = "weighted" if policy == "hobbit" else policy
    n_slot = slots_for_budget(trace, budget_mb) if n_slot is None else n_slot
    experts = np.ascontiguousarray(trace.experts, dtype=np.int32)
    seq_start = np.ascontiguousarray(trace.seq_start, dtype=np.uint8)
    t = ffi.new("struct hobbit_sim_trace *")
    t.n_tokens, t.n_layer, t.n_expert_used = experts.shape
    t.n_expert = trace.meta["n_expert"]
    t.experts = ffi.cast("const int32_t *", experts.ctypes.data)
    t.seq_start = ffi.cast("const uint8_t *", seq_start.ctypes.data)
    if high_precision is not None:
        high_precision = np.ascontiguousarray(high_precision, dtype=np.uint8)
        if high_precision.shape != experts.shape:
            raise ValueError(f"high_precision has shape {high_precision.shape}, the trace {experts.shape}")
        t.high_precision = ffi.cast("const uint8_t *", high_precision.ctypes.data)
    alpha = 0.0 if policy == "belady" else substitute_alpha
    if alpha > 0 or policy == "score":
        scores = router_scores(trace)
        t.scores = ffi.cast("const float *", scores.ctypes.data)
    if policy == "popularity" or (policy == "frequency" and popularity is not None):
        profile = expert_popularity(trace) if popularity is None else popularity
        profile = np.ascontiguousarray(profile, dtype=np.float32)
        if profile.shape != (t.n_layer, t.n_expert):
            raise HobbitError(f"the popularity profile is for {profile.shape[0]} MoE layers of {profile.shape[1]} "
                              f"experts; the trace has {t.n_layer} of {t.n_expert} (a profile of another model?)")
        t.popularity = ffi.cast("const float *", profile.ctypes.data)
    if prefetch_layers and policy != "belady":
        lookahead = trace.predicted.shape[2]
        if not 0 < prefetch_layers <= lookahead:
            raise HobbitError(f"{trace.meta['model']}: its trace guesses {lookahead} layers ahead; prefetch of "
                              f"{prefetch_layers} cannot be replayed (record it with `hobbitpy trace --lookahead`)")
        predicted = np.ascontiguousarray(trace.predicted, dtype=np.int32)
        t.predicted = ffi.cast("const int32_t *", predicted.ctypes.data)
        t.n_lookahead, t.prefetch_layers = lookahead, prefetch_layers
    w = ffi.new("struct hobbit_policy_weights *", dict(zip(("lru", "lfu", "lhu", "fld"), weights)))
    r = hobbit.simulate_cache(t, native_policy, w, n_slot, seed, low_miss_cost, alpha)
    misses = int(r.misses_high + r.misses_low)
    return SimResult(policy=label or policy, budget_mb=budget_mb, n_slot=n_slot, accesses=int(r.accesses),
                     hits=int(r.hits), misses=misses, bytes_read=(misses + int(r.prefetched)) * trace.meta["expert_bytes"],
                     miss_penalty=float(r.miss_penalty), substituted=int(r.substituted), prefetched=int(r.prefetched),
                     prefetch_used=int(r.prefetch_used))


def _simulate_per_layer(trace: Trace, budget_mb: float, policy: str, shallow_layers: int, *, label, high_precision,
                        popularity, prefetch_layers, **kwargs) -> SimResult:
    if prefetch_layers:
        raise HobbitError("prefetch loads into the next layers' pools: it is replayed with one shared pool only")
    if policy == "popularity" and popularity is None:
        popularity = expert_popularity(trace)
    slots = slots_per_layer(trace, budget_mb, shallow_layers)
    parts = []
    for layer, n in enumerate(slots):
        one = dataclasses.replace(trace, experts=trace.experts[:, layer:layer + 1], weights=trace.weights[:, layer:layer + 1],
                                  probs=trace.probs[:, layer:layer + 1], predicted=trace.predicted[:, layer:layer + 1],
                                  meta=trace.meta | {"n_moe_layer": 1}, neurons=None, inputs=None)
        parts.append(simulate(one, budget_mb, policy, n_slot=n,
                              high_precision=None if high_precision is None else high_precision[:, layer:layer + 1],
                              popularity=None if popularity is None else popularity[layer:layer + 1], **kwargs))
    total = {f: sum(getattr(r, f) for r in parts) for f in ("n_slot", "accesses", "hits", "misses", "bytes_read",
                                                             "miss_penalty", "substituted", "prefetched", "prefetch_used")}
    return SimResult(policy=label or f"{policy} per layer", budget_mb=budget_mb, **total)


def simulate_preset(trace: Trace, budget_mb: float, preset: str, *, popularity: np.ndarray | None = None,
                    low_miss_cost: float = 1.0) -> SimResult:
    """A preset's cache rules replayed (presets.py): its policy, its substitution, its decode
    prefetch (at most as many layers ahead as the trace guessed) and, with a low precision,
    its T1 split of the misses. What the replay leaves out: a pool per layer (Fate's
    allocation; one shared pool here), prompts (a trace is decode steps: Fate's low-precision
    share of a prompt's experts), guesses wider than top-k (the trace records k),
    T2's skips, and the importance preset's choice of the top-score guesses only (the
    trace has no scores for its guesses: every guess is prefetched). The corm preset reads
    whole experts, as the runtime does; its neuron cache is `simulate_neurons`'s replay."""
    settings = preset_settings(preset)
    lookahead = trace.predicted.shape[2]
    return simulate(trace, budget_mb, settings.get("policy", "lru"), popularity=popularity,
                    substitute_alpha=settings.get("substitute_alpha", 0.0),
                    prefetch_layers=min(settings.get("prefetch_layers", 0), lookahead),
                    t1=settings.get("t1", DEFAULT_T1) if settings.get("low") else None,
                    low_miss_cost=low_miss_cost, label=f"{preset} preset")


def simulate_all(trace: Trace, budgets_mb: list[float], policies=DEFAULT_POLICIES, **kwargs) -> list[SimResult]:
    return [simulate(trace, b, p, **kwargs) for b in budgets_mb for p in policies]


def format_table(results: list[SimResult]) -> str:
    """One block per budget; every policy also as a ratio to Belady's misses and penalty."""
    lines = []
    for budget in dict.fromkeys(r.budget_mb for r in results):
        rows = [r for r in results if r.budget_mb == budget]
        best = next((r for r in rows if r.policy.split()[0] == "belady"), None)  # "belady" or "belady per layer"
        lines.append(f"budget {budget:g} MB ({rows[0].n_slot} slots), {rows[0].accesses} expert selections")
        substituting = any(r.substituted for r in rows)
        prefetching = any(r.prefetched for r in rows)
        width = max(9, *(len(r.policy) for r in rows))
        lines.append(f"  {'policy':<{width}} {'hit ratio':>9} {'misses':>9} {'MB read':>10} {'penalty':>9} "
                     f"{'misses/Belady':>13} {'penalty/Belady':>14}" + (f" {'substituted':>11}" if substituting else "")
                     + (f" {'prefetched':>10} {'used':>6}" if prefetching else ""))
        for r in rows:
            ratio_m = f"{r.misses / best.misses:.3f}" if best and best.misses else "-"
            ratio_p = f"{r.miss_penalty / best.miss_penalty:.3f}" if best and best.miss_penalty else "-"
            lines.append(f"  {r.policy:<{width}} {r.hit_ratio:>9.3f} {r.misses:>9d} {r.bytes_read / MB:>10.1f} "
                         f"{r.miss_penalty:>9.1f} {ratio_m:>13} {ratio_p:>14}"
                         + (f" {r.substituted:>11d}" if substituting else "")
                         + (f" {r.prefetched:>10d} {r.prefetch_used / r.prefetched if r.prefetched else 0:>6.2f}"
                            if prefetching else ""))
    return "\n".join(lines)
