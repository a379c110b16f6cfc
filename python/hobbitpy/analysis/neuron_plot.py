"""`hobbitpy plot TRACE.npz --neurons`: CORM's Fig. 2 and Fig. 5b for a trace recorded with
`trace --neurons`: by MoE layer, the active share of a selected expert's neurons at each
threshold, and how much of it the previous layer's input predicts (recall)."""

from __future__ import annotations

from ..errors import HobbitError
from .neurons import summary_rows
from ..files.trace_file import Trace
from .trace_plot import png_of, trace_title


def plot_neurons(trace: Trace, title: str | None = None) -> bytes:
    """The PNG of the two panels; HobbitError for a trace without neuron statistics."""
    if trace.neurons is None:
        raise HobbitError(f"{trace.meta['model']}: this trace has no neuron statistics (record it with "
                          "`hobbitpy trace --neurons THETA,...`)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary_rows(trace.neurons)
    L = trace.neurons.active.shape[1]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for theta in trace.neurons.thetas.tolist():
        mine = [r for r in rows if r["theta"] == theta and r["layer"] != "all"]
        layers = [r["layer"] for r in mine]
        axes[0].plot(layers, [r["active"] for r in mine], marker="o", label=f"θ = {theta:g}")
        axes[1].plot(layers, [r["recall"] for r in mine], marker="o", label=f"θ = {theta:g}")
    axes[0].set_title("active neurons of a selected expert (|SiLU(W1 x)| > θ)")
    axes[0].set_ylabel("share of the expert's neurons")
    axes[1].set_title("active neurons predicted from the previous layer's input")
    axes[1].set_ylabel("recall")
    for ax in axes:
        ax.set_xlabel("MoE layer")
        ax.set_xticks(range(L))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower left")
    return png_of(fig, title or trace_title(trace))
