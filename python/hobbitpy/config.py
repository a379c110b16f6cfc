"""Offload settings as data: validated once, turned into the native struct in one place."""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024

# cache policies of the runtime (hobbit.h enum hobbit_policy), by name
POLICIES = ("lru", "lfu", "lhu", "fld", "random", "weighted")


@dataclass(frozen=True)
class OffloadConfig:
    """How the routed experts of a MoE model are served."""

    enabled: bool = True
    """False runs stock llama.cpp (every expert mapped from the file, the reference)."""

    cache_mb: float | None = None
    """Expert cache budget in MiB; None sizes it from the memory actually available."""

    prefetch_layers: int = 0
    """0 loads on demand only; 1 also prefetches, during decode, the experts the next layer's router picks on the current layer's input."""

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

    def __post_init__(self) -> None:
        if self.cache_mb is not None and not self.cache_mb > 0:
            raise ValueError(f"cache_mb must be positive, got {self.cache_mb}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")
        if self.prefetch_layers not in (0, 1):
            raise ValueError(f"prefetch_layers must be 0 or 1, got {self.prefetch_layers}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown cache policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        w = self.policy_weights
        if len(w) != 4 or any(x < 0 for x in w) or abs(sum(w) - 1.0) > 1e-6:
            raise ValueError(f"policy_weights must be four non-negative weights (LRU, LFU, LHU, FLD) summing to 1, got {w}")

    @property
    def budget_bytes(self) -> int | None:
        return None if self.cache_mb is None else int(self.cache_mb * MB)

    def to_native(self, budget_bytes: int):
        """The hobbit_params struct for a budget in bytes."""
        from ._native import ffi, lib

        params = ffi.new("struct hobbit_params *", lib.hobbit_default_params())
        params.budget_bytes = budget_bytes
        params.prefetch_layers = self.prefetch_layers
        params.direct_io = self.direct_io
        params.n_io_threads = self.io_threads
        params.policy = POLICIES.index(self.policy)
        params.policy_weights = {"lru": self.policy_weights[0], "lfu": self.policy_weights[1],
                                 "lhu": self.policy_weights[2], "fld": self.policy_weights[3]}
        params.seed = self.seed
        return params
