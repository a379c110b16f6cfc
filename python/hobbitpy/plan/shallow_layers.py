"""Fate's shallow-favoring allocation (§4.4): where the shallow layers end, from a trace.

The router of the next layer, applied to this layer's input, names most of the experts the
next layer will pick, but less well in the shallow layers, where the routers spread their
weight evenly; and nothing predicts the first MoE layer. Prefetch covers a deep layer's
misses, not a shallow one's: so the shallow layers get room for all of their experts and the
deep ones share the rest (`--shallow-layers N`, a pool per layer: hobbit-pool-plan).
"""

from __future__ import annotations

import numpy as np

from ..files.trace_file import Trace

# a layer is deep once its experts are predicted at least this share as well as the best layer's
DEEP_ACCURACY_SHARE = 0.9


def layer_prediction_accuracy(trace: Trace) -> np.ndarray:
    """Per MoE layer, the share of its selected experts that the previous layer's prediction
    (its router on the previous layer's input, the trace's `predicted`) named; 0 for the first
    layer, which nothing predicts."""
    experts, predicted = trace.experts, trace.predicted[:, :, 0, :]
    n_layer = experts.shape[1]
    accuracy = np.zeros(n_layer)
    for layer in range(1, n_layer):
        chosen, guess = experts[:, layer, :], predicted[:, layer - 1, :]
        valid = chosen >= 0
        named = (chosen[:, :, None] == guess[:, None, :]).any(axis=2) & valid
        accuracy[layer] = named.sum() / max(1, valid.sum())
    return accuracy


def shallow_boundary(accuracy: np.ndarray, share: float = DEEP_ACCURACY_SHARE) -> int:
    """How many leading MoE layers are shallow: the first layer from which every layer is
    predicted at least `share` as well as the best one begins the deep ones (at least 1: the
    first layer is never predicted)."""
    target = share * float(accuracy.max())
    boundary = len(accuracy)
    while boundary > 0 and accuracy[boundary - 1] >= target:
        boundary -= 1
    return max(1, boundary)
