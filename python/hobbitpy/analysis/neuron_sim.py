"""`hobbitpy simulate TRACE --neurons THETA`: the bytes CORM's neuron cache reads per token,
against an expert-granular cache of the same bytes, replayed by libhobbit's neuron cache
(hobbit-neuron-sim-cache.h) on the neuron sets a trace recorded with `trace --neurons`.

Which neurons a selection needs, by variant:

- ``expert``: every one (a whole expert per miss: the expert-granular LRU cache);
- ``corm``: those predicted from the previous MoE layer's input, in W1, W3 and W2 alike
  (CORM; the first MoE layer whole);
- ``oracle``: the exactly active ones (a perfect predictor);
- ``w1-first``: W1 whole, then the exactly active rows of W3 and columns of W2 (what the
  gate computes decides the rest; no prediction).

A cached expert keeps the union of what it read; above the limit the whole expert is read.
Bytes per neuron are the trace's expert bytes over three projections of n_ff neurons.

The slow tier reads in granules: a file is read a page at a time (4 KB), so a neuron costs
the whole page it lies on, and the page brings its neighbours along (they join the cache).
With `granule_bytes` a selection's needed neurons are widened to every neuron of the
granules they touch (a neuron-major layout, each projection's rows page-aligned per
expert); 0 counts single neurons (a tier that moves bytes, as CORM's CPU-to-GPU copies).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..binding import hobbit
from ..binding.native import ffi
from ..settings.config import MB, NEURON_LIMIT_CORM
from ..errors import HobbitError
from ..files.trace_file import Trace

NEURON_VARIANTS = ("expert", "corm", "oracle", "w1-first")
# a page: the smallest read of a file through the page cache or O_DIRECT
DEFAULT_GRANULE_BYTES = 4096


@dataclass
class NeuronSimResult:
    budget_mb: float
    theta: float
    variant: str
    accesses: int
    hits: int              # selections that read nothing
    whole: int             # selections over the limit (the whole expert)
    bytes_per_token: float
    requests_per_token: float
    ratio_to_expert: float | None = None  # bytes against the expert-granular cache of the same budget

    def as_dict(self) -> dict:
        return asdict(self)


def widen_to_granules(bits: np.ndarray, n_neuron: int, per_granule: int) -> np.ndarray:
    """Packed neuron bitmaps [..., bytes] with every neuron of a touched granule set."""
    if per_granule <= 1:
        return bits
    unpacked = np.unpackbits(bits, axis=-1, count=n_neuron, bitorder="little")
    n_granule = -(-n_neuron // per_granule)
    padded = np.zeros((*unpacked.shape[:-1], n_granule * per_granule), np.uint8)
    padded[..., :n_neuron] = unpacked
    touched = padded.reshape(*unpacked.shape[:-1], n_granule, per_granule).any(axis=-1)
    wide = np.repeat(touched, per_granule, axis=-1)[..., :n_neuron]
    return np.ascontiguousarray(np.packbits(wide, axis=-1, bitorder="little"))


def _needs(trace: Trace, j: int, variant: str, per_granule: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(W1, W3/W2) neuron bitmaps of every selection at threshold index j; None = every neuron."""
    s = trace.neurons
    n_neuron = int(trace.meta["n_ff_expert"])
    if variant == "expert":
        return None, None
    if variant == "corm":
        bits = widen_to_granules(np.ascontiguousarray(s.predicted_bits[..., j, :]), n_neuron, per_granule)
        return bits, bits
    active = widen_to_granules(np.ascontiguousarray(s.active_bits[..., j, :]), n_neuron, per_granule)
    return (active if variant == "oracle" else None), active


def simulate_neurons(trace: Trace, budget_mb: float, theta: float, variants=NEURON_VARIANTS,
                     limit: float = NEURON_LIMIT_CORM, granule_bytes: int = DEFAULT_GRANULE_BYTES) -> list[NeuronSimResult]:
    """Each variant's replay at one budget and threshold (one the trace recorded), reading in
    granules of granule_bytes (0: single neurons)."""
    s = trace.neurons
    if s is None or s.active_bits is None:
        raise HobbitError(f"{trace.meta['model']}: this trace has no neuron sets (record it with "
                          "`hobbitpy trace --neurons THETA,...`)")
    matches = np.flatnonzero(np.isclose(s.thetas, theta))
    if matches.size == 0:
        raise HobbitError(f"the trace recorded thresholds {', '.join(f'{x:g}' for x in s.thetas)}, not {theta:g}")
    j = int(matches[0])
    n, L, k = trace.experts.shape
    n_neuron = int(trace.meta["n_ff_expert"])
    neuron_bytes = max(1, int(trace.meta["expert_bytes"]) // (3 * n_neuron))
    budget = int(budget_mb * MB)
    if budget < k * 3 * n_neuron * neuron_bytes:
        raise HobbitError(f"a budget of {budget_mb:g} MB cannot hold one token's {k} whole experts")
    if granule_bytes < 0:
        raise ValueError(f"the read granule must be 0 (single neurons) or a number of bytes, got {granule_bytes}")
    per_granule = max(1, granule_bytes // neuron_bytes) if granule_bytes else 1
    experts = np.ascontiguousarray(trace.experts, np.int32)
    results = []
    for variant in variants:
        w1, rest = _needs(trace, j, variant, per_granule)
        sim = ffi.new("struct hobbit_neuron_sim *")
        sim.n_tokens, sim.n_layer, sim.n_expert, sim.n_expert_used, sim.n_neuron = n, L, trace.meta["n_expert"], k, n_neuron
        sim.experts = ffi.cast("const int32_t *", experts.ctypes.data)
        sim.need_w1 = ffi.NULL if w1 is None else ffi.cast("const uint8_t *", w1.ctypes.data)
        sim.need_rest = ffi.NULL if rest is None else ffi.cast("const uint8_t *", rest.ctypes.data)
        sim.neuron_bytes, sim.budget_bytes = neuron_bytes, budget
        sim.limit = 0.0 if variant == "expert" else limit
        out = hobbit.simulate_neurons(sim)
        results.append(NeuronSimResult(budget_mb, float(s.thetas[j]), variant, out.accesses, out.hits, out.whole,
                                       out.bytes_read / max(1, n), out.requests / max(1, n)))
    base = next((r.bytes_per_token for r in results if r.variant == "expert"), None)
    for r in results:
        r.ratio_to_expert = r.bytes_per_token / base if base else None
    return results


def format_neuron_table(results: list[NeuronSimResult]) -> str:
    lines = [f"  {'budget MB':>9} {'theta':>6} {'variant':<9} {'MB/token':>9} {'x expert':>8} {'reads/tok':>9} "
             f"{'hit':>6} {'whole':>6}"]
    for r in results:
        ratio = f"{r.ratio_to_expert:8.2f}" if r.ratio_to_expert is not None else f"{'-':>8}"
        lines.append(f"  {r.budget_mb:9.2f} {r.theta:6g} {r.variant:<9} {r.bytes_per_token / MB:9.3f} {ratio} "
                     f"{r.requests_per_token:9.1f} {r.hits / max(1, r.accesses):6.3f} {r.whole / max(1, r.accesses):6.3f}")
    return "\n".join(lines)
