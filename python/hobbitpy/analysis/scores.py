"""HOBBIT's eq. 2 on recorded gate weights: how unimportant each selection is, and the
threshold that puts a given share of selections above it (calibrate, simulate)."""

from __future__ import annotations

import numpy as np


def selection_scores(weights: np.ndarray) -> np.ndarray:
    """HOBBIT eq. 2 for every selection: [..., k] gate weights -> [..., k] scores (the
    normalized weight of the selections ranked above; 0 for the first). The runtime's
    precision_scores, in numpy."""
    a = np.abs(weights.astype(np.float64))
    order = np.argsort(-a, axis=-1, kind="stable")
    ranked = np.take_along_axis(a, order, -1)
    total = ranked.sum(-1, keepdims=True)
    above = np.cumsum(ranked, -1) - ranked
    ranked_scores = np.where(total > 0, above / np.where(total > 0, total, 1.0), 0.0)
    scores = np.empty_like(ranked_scores)
    np.put_along_axis(scores, order, ranked_scores, -1)
    return scores


def threshold_for_share(scores: np.ndarray, share: float) -> float:
    """The score threshold above which `share` of the selections lie."""
    return float(np.quantile(scores[np.isfinite(scores)], 1.0 - share))
