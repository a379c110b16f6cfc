"""Offload settings as data: validated once, turned into the native struct in one place."""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024


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

    def __post_init__(self) -> None:
        if self.cache_mb is not None and not self.cache_mb > 0:
            raise ValueError(f"cache_mb must be positive, got {self.cache_mb}")
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {self.io_threads}")
        if self.prefetch_layers not in (0, 1):
            raise ValueError(f"prefetch_layers must be 0 or 1, got {self.prefetch_layers}")

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
        return params
