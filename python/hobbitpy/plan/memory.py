"""How much memory this process may use, and the expert budget that leaves.

The budget must hold where the process actually runs: inside a memory cgroup
(a container, a benchmark cap) the cgroup limit counts, not the machine's RAM.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
import pathlib

from ..binding import hobbit
from ..settings.config import MB, OffloadConfig
from ..errors import BudgetError
from ..files.model_file import ModelInfo

# what the estimate of a context's buffers cannot see: thread stacks and pools, the I/O
# threads' bounce buffers, allocator slack (measured: tests/runtime/test_memory.py)
SLACK_BYTES = 24 * MB
# ... and what no estimate should be trusted with: the mapped non-expert weights every token
# reads stay in the page cache only while nothing crowds them out, and a working set a few
# MB larger than the page cache is missed whole, token after token, under the kernel's LRU.
# At real size (Qwen3-30B-A3B's shape, 12 GiB cap) the planned process was 20-40 MB larger
# than its estimate: 770 MB of page faults a token, 0.18-0.24 tok/s against 1.04 at 8 GiB
# (docs/BENCHMARKS.md at 5f63b2a). So a budget derived from the memory leaves this share of it free.
HEADROOM_SHARE = 0.02
# the O_DIRECT alignment a reader's bounce buffer adds to a slice (hobbit-expert-store.cpp)
READER_ALIGN_BYTES = 3 * 4096
# a row reader's buffer (--row-readers)
ROW_READ_BYTES = hobbit.ROW_READ_BYTES
# When the experts do not all fit, the widest ubatch's compute buffer (for a MoE, n_ubatch rows
# of every selected expert's gate, up and activation) may take at most this share of the
# memory left for it and the expert cache together: on the inflated ref-mixtral under a
# 246 MB cap a 152-token ubatch took 46 MB, a third of what the experts got. Decoding needs
# one row; a narrower ubatch only splits a long prompt into more passes.
COMPUTE_SHARE = 1 / 8
# ... but no narrower than this (each pass of a prompt loads the experts its tokens select)
MIN_UBATCH = 32


@dataclass(frozen=True)
class ContextShape:
    """The context a model is loaded with (llama_cpp.Llama's arguments and defaults)."""

    n_ctx: int = 512
    n_batch: int = 512
    n_ubatch: int | None = None  # None: left to the planner (fit_ubatch), at most n_batch
    logits_all: bool = False

    @classmethod
    def of(cls, llama_kwargs: dict) -> "ContextShape":
        return cls(**{k: llama_kwargs[k] for k in ("n_ctx", "n_batch", "n_ubatch", "logits_all") if k in llama_kwargs})


@dataclass(frozen=True)
class ContextSizes:
    """What llama.cpp allocates for a context beside the weights (bytes)."""

    kv: int        # K and V cache, f16, every layer
    compute: int   # the compute buffer of the widest ubatch: the MoE FFN's gate, up and activation rows dominate
    logits: int    # llama.cpp's output buffer and llama_cpp's scores array

    @property
    def total(self) -> int:
        return self.kv + self.compute + self.logits


def context_sizes(info: ModelInfo, shape: ContextShape) -> ContextSizes:
    """The buffers a context of this shape allocates for the model, from its hyperparameters
    (as llama.cpp sizes them; tests/runtime/test_memory.py checks the estimate against llama.cpp's own
    figures for every test architecture)."""
    n_ctx = shape.n_ctx or info.n_ctx_train or 512
    n_ctx_kv = -(-n_ctx // 256) * 256  # llama.cpp pads the KV cache
    n_batch = min(shape.n_batch, n_ctx)
    n_ubatch = min(shape.n_ubatch or n_batch, n_batch)
    f32 = 4
    kv = info.n_layer * n_ctx_kv * info.n_head_kv * (info.n_embd_head_k + info.n_embd_head_v) * 2
    # per token of a ubatch, as llama.cpp reserves it (for every token's logits): the widest
    # of the FFN's intermediate rows (gate, up, activation: three live at once), the attention
    # scores and the logits, plus a dozen n_embd-wide rows
    ffn = 3 * info.n_expert_used * info.n_ff_expert + 3 * info.n_ff_dense
    per_token = (max(ffn, 2 * n_ctx_kv * info.n_head, info.n_vocab) + 12 * info.n_embd) * f32
    n_outputs = n_batch if shape.logits_all else 1
    compute = n_ubatch * per_token
    # llama.cpp's output buffer, and the rows of llama_cpp's scores array they are copied to
    logits = 2 * n_outputs * info.n_vocab * f32
    return ContextSizes(kv=kv, compute=compute, logits=logits)


# The context a model gets when none is asked (run, serve, trace and the API alike): as llama.cpp
# gives it (n_ctx 0 with --fit), the model's training context, shrunk to fit the memory but not
# below its fit_params_min_ctx; here the expert cache shares that memory, so the context's
# buffers may take at most CONTEXT_SHARE of it (a 40,960-token Qwen3-30B-A3B context alone is
# 3.8 GB of KV cache: a third of a 12 GiB machine, taken from the experts).
CONTEXT_SHARE = 1 / 8
MIN_DEFAULT_CTX = 4096  # llama.cpp's fit_params_min_ctx
CONTEXT_PAD = 256  # llama.cpp rounds a context up to a multiple of this


def default_context(info: ModelInfo, available_bytes: int, shape: ContextShape = ContextShape()) -> int:
    """The model's training context, at most what fits in CONTEXT_SHARE of available_bytes
    (with shape's batch and logits), at least MIN_DEFAULT_CTX (or the training context, if
    shorter); a multiple of CONTEXT_PAD."""
    train = info.n_ctx_train or MIN_DEFAULT_CTX
    floor = -(-min(train, MIN_DEFAULT_CTX) // CONTEXT_PAD)
    top = -(-train // CONTEXT_PAD)

    def fits(pads: int) -> bool:
        sizes = context_sizes(info, dataclasses.replace(shape, n_ctx=pads * CONTEXT_PAD))
        return sizes.total <= CONTEXT_SHARE * available_bytes

    while floor < top:  # the largest multiple that fits: the buffers grow with the context
        mid = (floor + top + 1) // 2
        floor, top = (mid, top) if fits(mid) else (floor, mid - 1)
    return floor * CONTEXT_PAD


def padded_context(n_ctx: int) -> int:
    """n_ctx rounded up as llama.cpp rounds it. llama_cpp sizes its token arrays by the n_ctx
    it was given, so text past the one asked (within llama.cpp's) would overflow them: the
    commands ask for whole multiples, while the API takes n_ctx as given (a small context keeps
    llama_cpp's logits arrays, n_ctx x n_vocab, small under a tight cap)."""
    return -(-n_ctx // CONTEXT_PAD) * CONTEXT_PAD


def headroom_bytes(available: int) -> int:
    """The memory a budget derived from `available` leaves free beside everything it counts."""
    return int(HEADROOM_SHARE * max(0, available))


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


def _reclaimable_file_bytes(stat: pathlib.Path, prefix: str, busy_fields: tuple[str, ...]) -> int:
    """Page cache charged to a cgroup that the kernel takes back when asked, without writing
    or faulting anything: clean file pages no process maps. The active and the inactive list
    alike (which list a page is on depends on how often and how recently it was read: counting
    only the inactive one made a run's budget hang on the kernel's timing), less the pages
    mapped (a model's weights in use) and those dirty or under writeback."""
    cache = _stat_field(stat, f"{prefix}active_file") + _stat_field(stat, f"{prefix}inactive_file")
    busy = sum(_stat_field(stat, f"{prefix}{field}") for field in busy_fields)
    return max(0, cache - busy)


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
                    free = limit - usage + _reclaimable_file_bytes(node / "memory.stat", "",
                                                                     ("file_mapped", "file_dirty", "file_writeback"))
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
                free = limit - usage + _reclaimable_file_bytes(stat, "total_", ("mapped_file", "dirty", "writeback"))
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
    shared_pool: bool = False
    """A pool per layer was asked for (shallow_layers) but its minimum does not fit the budget:
    run with one pool shared by every layer instead (shallow_layers dropped)."""


def return_freed_memory() -> None:
    """Give the heap a closed model freed back to the system (glibc keeps it otherwise: 87 MB of
    a small model's expert cache stayed charged to the process, and a model loaded next in the
    same process planned its cache without them). Nothing where the C library has no malloc_trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: glibc's, if it is glibc
    if trim is not None:
        trim(0)


def process_resident_bytes() -> int:
    """What this process already holds in memory (VmRSS)."""
    return _stat_field(pathlib.Path("/proc/self/status"), "VmRSS:") * 1024


def io_buffer_bytes(config: OffloadConfig, levels: tuple[ModelInfo, ...]) -> int:
    """The readers' buffers: each I/O thread keeps, per level, one buffer of a projection's
    slice (O_DIRECT's bounce buffer, with an aligned page either side, or the staging buffer of
    a buffered read that repacks): a third of an expert where the projections are alike. With
    neuron reads, each row reader keeps one of ROW_READ_BYTES per level too."""
    row_readers = config.row_readers if config.neuron_layout is not None else 0
    return sum(config.io_threads * (level.max_slice_bytes + READER_ALIGN_BYTES) +
               row_readers * (ROW_READ_BYTES + READER_ALIGN_BYTES) for level in levels)


def fit_ubatch(info: ModelInfo, shape: ContextShape, config: OffloadConfig, levels: tuple[ModelInfo, ...] = (),
               available_bytes: int | None = None) -> int:
    """The ubatch a run should have: the one asked for (shape.n_ubatch), or, left open, the
    whole batch unless the experts are offloaded with a budget derived from the memory and do
    not all fit; then the widest power of two whose compute buffer takes at most COMPUTE_SHARE
    of the memory left for it and the experts (at least MIN_UBATCH). Stock llama.cpp's logits
    do not depend on the ubatch (tests/runtime/test_memory.py), so neither do hobbitpy's."""
    n_batch = min(shape.n_batch, shape.n_ctx or info.n_ctx_train or 512)
    full = min(shape.n_ubatch or n_batch, n_batch)
    if shape.n_ubatch is not None or not config.enabled or config.budget_bytes is not None or not info.is_moe:
        return full
    levels = levels or (info,)
    sizes = context_sizes(info, dataclasses.replace(shape, n_ubatch=full))
    available = available_bytes if available_bytes is not None else available_memory_bytes()
    room = available - (info.resident_bytes + sizes.kv + sizes.logits + io_buffer_bytes(config, levels) + SLACK_BYTES
                        + headroom_bytes(available))
    if room - sizes.compute >= sum(level.expert_bytes_total for level in levels):
        return full
    per_token = sizes.compute / full
    n_ubatch = 1 << (full.bit_length() - 1)
    while n_ubatch > MIN_UBATCH and n_ubatch * per_token > COMPUTE_SHARE * room:
        n_ubatch //= 2
    return min(full, n_ubatch)


def whole_memory_budget_mb(info: ModelInfo, shape: ContextShape, available_bytes: int | None = None) -> float:
    """An expert cache as large as memory allows and never larger than every expert: for a run
    whose outputs do not depend on the budget (recording routing), which must still offload."""
    plan = plan_offload(info, OffloadConfig(auto=False), context_sizes(info, shape).total, available_bytes=available_bytes)
    budget = plan.budget_bytes if plan.budget_bytes is not None else info.expert_bytes_total
    return max(budget, info.min_budget_bytes) / MB


def per_layer_min_bytes(levels: tuple[ModelInfo, ...]) -> int:
    """The smallest budget of a pool per MoE layer (the highest level, levels[0]): one token's
    top-k in each, beside the lower levels' one shared pool each."""
    high = levels[0]
    return high.expert_bytes_total // high.n_expert * high.n_expert_used + sum(l.min_budget_bytes for l in levels[1:])


def plan_offload(info: ModelInfo, config: OffloadConfig, context_bytes: int,
                 levels: tuple[ModelInfo, ...] = (), available_bytes: int | None = None,
                 gpu_bytes: int | None = None) -> OffloadPlan:
    """Decide whether and with what budget the experts are offloaded. context_bytes: what
    the context allocates beside the weights (context_sizes(...).total); levels: the files
    of the precision levels, high to low (the model itself or its high companion first),
    each of which needs its own minimum of slots; () = the model alone. available_bytes:
    the memory to plan for (default: what this process may still use now). gpu_bytes: the
    free memory of a GPU with memory of its own that holds every layer, the context and the
    expert pools (devices.gpu_free_bytes); the host then holds only the readers' buffers."""
    name = info.path
    if not config.enabled:
        return OffloadPlan(None, "offload off: stock llama.cpp path")
    if not info.is_moe:
        return OffloadPlan(None, f"{name} is a dense model (no routed experts): running it without offload")
    levels = levels or (info,)
    if config.shallow_layers is not None:
        # a pool per layer (Fate's shallow-favoring allocation) needs one token's top-k in every
        # layer; where the memory holds less, one pool shared by every layer still runs
        per_layer_min = per_layer_min_bytes(levels)
        plan = plan_offload(info, dataclasses.replace(config, shallow_layers=None), context_bytes, levels, available_bytes,
                            gpu_bytes)
        if plan.budget_bytes is None or plan.budget_bytes >= per_layer_min:
            return plan
        return dataclasses.replace(plan, shared_pool=True, reason=(
            f"{plan.reason}; a pool per layer (--shallow-layers) needs at least {per_layer_min / MB:.1f} MB: "
            "one pool shared by every layer instead"))
    ladder = levels[0] is not info  # the high level is a companion: the model's experts are never read
    min_bytes = sum(level.min_budget_bytes for level in levels)
    min_mb = min_bytes / MB
    io_bytes = io_buffer_bytes(config, levels)
    needs = info.resident_bytes + context_bytes + io_bytes + SLACK_BYTES
    if config.budget_bytes is not None:
        if config.budget_bytes < min_bytes:
            what = (f"{info.n_expert_used} experts of {info.expert_bytes / MB:.2f} MB, one token's top-k"
                    if len(levels) == 1 else f"one token's top-k at each of {len(levels)} precisions")
            raise BudgetError(f"{name}: an expert cache of {config.cache_mb:g} MB is below the minimum of {min_mb:.1f} MB "
                              f"({what})")
        available = available_bytes if available_bytes is not None else available_memory_bytes()
        room = max(0, available - needs - config.budget_bytes)
        return OffloadPlan(config.budget_bytes, f"expert cache {config.budget_bytes / MB:.1f} MB "
                                                f"of {info.expert_bytes_total / MB:.1f} MB of experts", room)

    available = available_bytes if available_bytes is not None else available_memory_bytes()
    if gpu_bytes is not None:
        return _plan_on_gpu(info, levels, context_bytes, io_bytes, available, gpu_bytes, ladder)
    needs += headroom_bytes(available)
    budget = available - needs
    all_bytes = sum(level.expert_bytes_total for level in levels)
    if budget >= all_bytes:
        if len(levels) == 1 and not ladder:
            return OffloadPlan(None, f"all {info.expert_bytes_total / MB:.1f} MB of experts fit in the "
                                     f"{available / MB:.0f} MB available: keeping them resident, no offload")
        budget = all_bytes  # every level's copy of every expert fits: no more is needed
    if budget < min_bytes:
        raise BudgetError(f"{name}: not enough memory: {available / MB:.0f} MB available, the resident weights "
                          f"({info.resident_bytes / MB:.0f} MB), the context's buffers ({context_bytes / MB:.0f} MB), "
                          f"the readers' buffers ({io_bytes / MB:.0f} MB) and {(SLACK_BYTES + headroom_bytes(available)) / MB:.0f} "
                          "MB of slack need "
                          f"{needs / MB:.0f} MB and the expert cache at least {min_mb:.1f} MB")
    return OffloadPlan(budget, f"expert cache {budget / MB:.1f} MB (from {available / MB:.0f} MB available; "
                               f"{needs / MB:.0f} MB for the rest) of {all_bytes / MB:.1f} MB of experts",
                       available - needs - budget)


def _plan_on_gpu(info: ModelInfo, levels: tuple[ModelInfo, ...], context_bytes: int, io_bytes: int, available: int,
                 gpu_bytes: int, ladder: bool) -> OffloadPlan:
    """plan_offload where a GPU with memory of its own holds the layers, the context and the
    pools: the budget is what its free memory leaves; the host keeps the readers' buffers."""
    name = info.path
    min_bytes = sum(level.min_budget_bytes for level in levels)
    all_bytes = sum(level.expert_bytes_total for level in levels)
    host_needs = io_bytes + SLACK_BYTES
    if available < host_needs:
        raise BudgetError(f"{name}: not enough memory: {available / MB:.0f} MB available, the readers' buffers and "
                          f"slack need {host_needs / MB:.0f} MB")
    needs = info.resident_bytes + context_bytes + SLACK_BYTES + headroom_bytes(gpu_bytes)
    budget = gpu_bytes - needs
    if budget >= all_bytes:
        if len(levels) == 1 and not ladder:
            return OffloadPlan(None, f"all {info.expert_bytes_total / MB:.1f} MB of experts fit in the GPU's "
                                     f"{gpu_bytes / MB:.0f} MB free: keeping them resident, no offload")
        budget = all_bytes
    if budget < min_bytes:
        raise BudgetError(f"{name}: not enough GPU memory: {gpu_bytes / MB:.0f} MB free, the resident weights "
                          f"({info.resident_bytes / MB:.0f} MB) and the context's buffers ({context_bytes / MB:.0f} MB) "
                          f"need {needs / MB:.0f} MB and the expert cache at least {min_bytes / MB:.1f} MB; put fewer "
                          "layers on the GPU (-ngl)")
    return OffloadPlan(budget, f"expert cache {budget / MB:.1f} MB on the GPU (from {gpu_bytes / MB:.0f} MB free; "
                               f"{needs / MB:.0f} MB for the rest) of {all_bytes / MB:.1f} MB of experts",
                       available - host_needs)


def cache_too_small_note(info: ModelInfo, n_slot: int) -> str | None:
    """What to say when the cache holds fewer experts than one token selects (k in every MoE
    layer): least-recently-used eviction then throws each expert out before the next token
    needs it, and nearly every selection is a read (0 % hits on the shipped model at 4 MB);
    None when it holds them."""
    selected = info.n_expert_used * info.n_layer_moe
    if not info.is_moe or n_slot >= selected:
        return None
    needed_mb = -(-selected * info.expert_bytes // MB)
    return (f"the cache holds {n_slot} experts and one token selects {selected} ({info.n_expert_used} in each of "
            f"{info.n_layer_moe} layers): each is evicted before the next token needs it, so expect few hits; "
            f"--cache-mb {needed_mb} or more holds one token's")
