"""Offload settings as data: validated once, turned into the native struct in one place."""

from __future__ import annotations

from dataclasses import dataclass
import os

MB = 1024 * 1024

# cache policies of the runtime (hobbit.h enum hobbit_policy), by name; "hobbit" is
# HOBBIT's multidimensional policy, the weighted mix of eq. 3 ("weighted" is its old name)
POLICIES = ("lru", "lfu", "lhu", "fld", "random", "weighted", "hobbit")
_NATIVE_POLICY = {"lru": 0, "lfu": 1, "lhu": 2, "fld": 3, "random": 4, "weighted": 5, "hobbit": 5}

# where a missed expert runs (hobbit.h enum hobbit_mode, in its order)
MODES = ("gpu-centric", "cooperative", "auto")

# what a hit at another precision does (hobbit.h enum hobbit_hit_policy, in its order)
HIT_POLICIES = ("found", "upgrade", "exact")

# HOBBIT's thresholds for Mixtral-8x7B (§3.2): 67 % of selections high, 30 % low, 3 % skipped
DEFAULT_T1 = 0.6
MAX_PREFETCH_LAYERS = 8
DEFAULT_T2 = 0.9


@dataclass(frozen=True)
class OffloadConfig:
    """How the routed experts of a MoE model are served."""

    enabled: bool = True
    """False runs stock llama.cpp (every expert mapped from the file, the reference)."""

    cache_mb: float | None = None
    """Expert cache budget in MiB; None sizes it from the memory actually available."""

    prefetch_layers: int = 0
    """0 loads on demand only; P > 0 also prefetches, during decode, the experts the next P layers' routers
    pick on the current layer's input, going one layer deeper only while the predicted experts are all cached
    (HOBBIT §3.3)."""

    direct_io: bool = True
    """Read experts with O_DIRECT (no double caching in the page cache) where the file system allows it."""

    io_threads: int = 2
    """Threads reading experts: 2 keeps the disk busy while one copies out of its O_DIRECT buffer."""

    policy: str = "lru"
    """Which cached expert to evict: lru, lfu, lhu, fld, random, or weighted (HOBBIT eq. 3 with policy_weights)."""

    policy_weights: tuple[float, float, float, float] = (0.25, 0.25, 0.25, 0.25)
    """Weights of LRU, LFU, LHU and FLD for the weighted policy; they sum to 1."""

    seed: int = 0
    """Seed of the random policy."""

    low: str | None = None
    """Lower-precision copies of the experts (mixed precision, HOBBIT §3.2): a GGUF type name
    (Q2_K: the companion file `hobbitpy prepare` writes next to the model) or a file path."""

    mid: str | None = None
    """An optional middle level between the model's precision and ``low`` (e.g. Q4_K)."""

    high: str | None = None
    """The high level as a companion too (a precision ladder, e.g. Q4_K over a Q8_0 model): a type name or
    a file path. The model file's experts are then never read; its other weights still serve at its own
    precision. None: the model's own experts are the high level."""

    t1: float = DEFAULT_T1
    """A selection whose score (eq. 2) is at most t1 is served at high precision when missed."""

    t_mid: float | None = None
    """With ``mid``: a score at most t_mid goes to the middle level; None = halfway between t1 and t2."""

    t2: float = DEFAULT_T2
    """A missed selection whose score is above t2 is skipped (it contributes nothing to that token)."""

    level_shares: tuple[float, ...] | None = None
    """How the budget above the minimum is split among the levels, high first; None = automatic: the
    lowest level gets room for a copy of every expert (up to 85 % of the budget), the others the rest."""

    hits: str = "upgrade"
    """What a hit at another precision than wanted does: "found" uses it; "upgrade" uses it and, when it
    was lower, loads the wanted copy in the background; "exact" serves only the wanted precision
    (and skips what the rule skips), to measure the rule's own effect on quality."""

    mode: str = "gpu-centric"
    """Where a missed expert runs: "gpu-centric" loads it into the cache; "cooperative" computes it in place
    on the mapped model file; "auto" decides per expert and ubatch with a latency model measured at start-up
    (in place for wide ubatches when faulting the file in is about as fast as loading, and for experts the
    page cache already holds, while the page cache has room for two layers). gpu-centric is the default:
    under tight memory caps auto measured up to 1.5x slower decode (docs/BENCHMARKS.md)."""

    warm: bool = True
    """With mixed precision, fill the lowest level's pool with its experts in the background at start."""

    importance: tuple[tuple[float, ...], ...] | None = None
    """How much the routers weigh each expert, per MoE layer in order (the sum of its squared gate weights over
    a trace; ``hobbitpy tune`` writes it into the profiles of its "placed" ladders). With two or more levels it
    places the experts statically for the budget the run gets: the most weighed at the highest level the budget
    still holds, the rest at the lowest (placement.py); every expert is then always served at its level, t1,
    t_mid and t2 are not used and nothing is skipped. With a budget that holds a copy of every expert, this is
    a mixed-precision model resident in memory, its bits where the routers put their weight. None: the
    thresholds decide per selection."""

    def __post_init__(self) -> None:
        if self.importance is not None:  # lists (a profile's JSON) are kept as tuples, so the config stays hashable
            object.__setattr__(self, "importance", tuple(tuple(float(x) for x in row) for row in self.importance))
        if self.cache_mb is not None and not self.cache_mb > 0:
            raise ValueError(f"cache_mb must be positive, got {self.cache_mb}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")
        if not 0 <= self.prefetch_layers <= MAX_PREFETCH_LAYERS:
            raise ValueError(f"prefetch_layers must be 0..{MAX_PREFETCH_LAYERS}, got {self.prefetch_layers}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown cache policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        w = self.policy_weights
        if len(w) != 4 or any(x < 0 for x in w) or abs(sum(w) - 1.0) > 1e-6:
            raise ValueError(f"policy_weights must be four non-negative weights (LRU, LFU, LHU, FLD) summing to 1, got {w}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.hits not in HIT_POLICIES:
            raise ValueError(f"unknown hit policy {self.hits!r}; choose one of {', '.join(HIT_POLICIES)}")
        if self.mid is not None and self.low is None:
            raise ValueError("a middle precision (mid) needs a low one (low) below it")
        if not 0.0 <= self.t1 <= self.t2 <= 1.0:
            raise ValueError(f"thresholds must satisfy 0 <= t1 <= t2 <= 1, got t1 {self.t1}, t2 {self.t2}")
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
        if self.level_shares is not None:
            if len(self.level_shares) != self.n_level or any(x < 0 for x in self.level_shares) or sum(self.level_shares) <= 0:
                raise ValueError(f"level_shares must be {self.n_level} non-negative numbers (one per precision level, "
                                 f"high first) with a positive sum, got {self.level_shares}")

    @property
    def n_level(self) -> int:
        """Precision levels: the model's own, then mid and low when given."""
        return 1 + (self.low is not None) + (self.mid is not None)

    @property
    def budget_bytes(self) -> int | None:
        return None if self.cache_mb is None else int(self.cache_mb * MB)

    def to_native(self, budget_bytes: int, level_paths: tuple[str | None, ...] = (None,), page_cache_room_bytes: int = -1,
                  placement: tuple[tuple[int, ...], ...] | None = None):
        """The hobbit_params struct for a budget in bytes, and the C strings and arrays it points
        to (keep them alive until the model has loaded). level_paths: the file of each level,
        high to low, None for the model's own experts (see companions.resolve_levels);
        placement: the level of every expert (placement.place_by_importance), or None."""
        from ._native import ffi, lib

        if len(level_paths) != self.n_level or None in level_paths[1:]:
            raise ValueError(f"{self.n_level} level files expected (the first may be None), got {level_paths}")
        params = ffi.new("struct hobbit_params *", lib.hobbit_default_params())
        params.budget_bytes = budget_bytes
        params.prefetch_layers = self.prefetch_layers
        params.direct_io = self.direct_io
        params.n_io_threads = self.io_threads
        params.policy = _NATIVE_POLICY[self.policy]
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
        params.t_mid = self.t_mid if self.t_mid is not None else (self.t1 + self.t2) / 2
        params.hit_policy = HIT_POLICIES.index(self.hits)
        params.warm_low = self.warm
        params.mode = MODES.index(self.mode)
        params.page_cache_room_bytes = page_cache_room_bytes
        if placement is not None:
            keep.append(ffi.new("int8_t[]", [x for row in placement for x in row]))
            params.expert_levels = keep[-1]
            params.n_expert_levels = len(keep[-1])
        return params, keep
