"""How much memory this process may use, and the expert budget that leaves.

The budget must hold where the process actually runs: inside a memory cgroup
(a container, a benchmark cap) the cgroup limit counts, not the machine's RAM.
"""

from __future__ import annotations

from dataclasses import dataclass
import pathlib

from .config import MB, OffloadConfig
from .errors import BudgetError
from .model_file import ModelInfo

# compute buffers, logits, the Python process itself: kept free on top of the
# weights and the KV cache when the budget is derived from available memory
HEADROOM_BYTES = 160 * MB


def _read_int(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _stat_field(path: pathlib.Path, field: str) -> int:
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == field:
                return int(parts[1])
    except OSError:
        pass
    return 0


def _cgroup_available_bytes() -> int | None:
    """Bytes the own memory cgroup still allows (reclaimable file cache counts as free)."""
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2: the limit may sit on any ancestor
            node = pathlib.Path("/sys/fs/cgroup") / rel.lstrip("/")
            while True:
                limit = _read_int(node / "memory.max")
                usage = _read_int(node / "memory.current")
                if limit is not None and usage is not None:
                    free = limit - usage + _stat_field(node / "memory.stat", "inactive_file")
                    best = free if best is None else min(best, free)
                if node == pathlib.Path("/sys/fs/cgroup") or node.parent == node:
                    break
                node = node.parent
        elif "memory" in controllers.split(","):  # cgroup v1
            node = pathlib.Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            stat = node / "memory.stat"
            limit = _stat_field(stat, "hierarchical_memory_limit") or _read_int(node / "memory.limit_in_bytes")
            usage = _read_int(node / "memory.usage_in_bytes")
            if limit and usage is not None and limit < (1 << 60):
                free = limit - usage + _stat_field(stat, "total_inactive_file")
                best = free if best is None else min(best, free)
    return best


def available_memory_bytes() -> int:
    """MemAvailable, or less when the process's memory cgroup allows less."""
    mem_available = _stat_field(pathlib.Path("/proc/meminfo"), "MemAvailable:") * 1024
    cgroup = _cgroup_available_bytes()
    return min(mem_available, cgroup) if cgroup is not None else mem_available


@dataclass(frozen=True)
class OffloadPlan:
    budget_bytes: int | None
    """Expert cache budget; None runs the stock path (every expert mapped)."""
    reason: str
    """One line for the user: why this plan."""
    page_cache_room_bytes: int = -1
    """Memory left beside the pools for the page cache (experts computed in place); -1 = not known."""


def plan_offload(info: ModelInfo, config: OffloadConfig, n_ctx: int,
                 companions: tuple[ModelInfo, ...] = ()) -> OffloadPlan:
    """Decide whether and with what budget the experts are offloaded; companions: the
    lower-precision levels' files, each of which needs its own minimum of slots."""
    name = info.path
    if not config.enabled:
        return OffloadPlan(None, "offload off: stock llama.cpp path")
    if info.n_split > 1:
        return OffloadPlan(None, f"{name} is split into {info.n_split} files, which offload does not handle yet: "
                                 "running it without offload")
    if not info.is_moe:
        return OffloadPlan(None, f"{name} is a dense model (no routed experts): running it without offload")
    min_bytes = info.min_budget_bytes + sum(c.min_budget_bytes for c in companions)
    # KV cache upper bound: K and V, f16, full width, every layer
    kv_bytes = 2 * info.n_layer * n_ctx * info.n_embd * 2
    min_mb = min_bytes / MB
    if config.budget_bytes is not None:
        if config.budget_bytes < min_bytes:
            what = (f"{info.n_expert_used} experts of {info.expert_bytes / MB:.2f} MB, one token's top-k" if not companions
                    else f"one token's top-k at each of {1 + len(companions)} precisions")
            raise BudgetError(f"{name}: an expert cache of {config.cache_mb:g} MB is below the minimum of {min_mb:.1f} MB "
                              f"({what})")
        room = max(0, available_memory_bytes() - info.resident_bytes - kv_bytes - config.budget_bytes)
        return OffloadPlan(config.budget_bytes, f"expert cache {config.budget_bytes / MB:.1f} MB "
                                                f"of {info.expert_bytes_total / MB:.1f} MB of experts", room)

    available = available_memory_bytes()
    budget = available - info.resident_bytes - kv_bytes - HEADROOM_BYTES
    if budget >= info.expert_bytes_total:
        return OffloadPlan(None, f"all {info.expert_bytes_total / MB:.1f} MB of experts fit in the "
                                 f"{available / MB:.0f} MB available: keeping them resident, no offload")
    if budget < min_bytes:
        raise BudgetError(f"{name}: not enough memory: {available / MB:.0f} MB available, the resident weights and "
                          f"KV cache need {(info.resident_bytes + kv_bytes + HEADROOM_BYTES) / MB:.0f} MB and the "
                          f"expert cache at least {min_mb:.1f} MB")
    return OffloadPlan(budget, f"expert cache {budget / MB:.1f} MB (from {available / MB:.0f} MB available) "
                               f"of {info.expert_bytes_total / MB:.1f} MB of experts", HEADROOM_BYTES)
