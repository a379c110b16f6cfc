"""The quality-speed frontier under one memory cap: decode tok/s against the mean KL
divergence from the model's own next-token distributions, stock llama.cpp on every uniform
quant as one curve and hobbitpy's configurations as points. A point is dominated when another
is at least as fast and at most as far from the model (and better in one of the two); that is
the only comparison a user whose memory cannot hold the model can act on.

Closeness is judged by divergence, not perplexity: on a weak model a lossy configuration can
lower the perplexity of a text (it predicts the text no better, only differently), while its
divergence from the model's distributions only grows; perplexity and top-1 agreement are
reported beside it.
"""

from __future__ import annotations

import io
import textwrap


def _point(s: dict) -> tuple[float, float] | None:
    if s.get("decode_tok_s") is None or s.get("mean_kl") is None:
        return None
    return s["decode_tok_s"], s["mean_kl"]


def mark_dominated(row: dict) -> None:
    """Set s["dominated_by"] (names) on every configuration of a cap's row with a speed and a
    divergence: those at least as fast and at most as far from the model, better in one."""
    points = [(s["config"], _point(s)) for s in row["configs"]]
    for s in row["configs"]:
        mine = _point(s)
        if mine is None:
            continue
        speed, kl = mine
        s["dominated_by"] = [name for name, p in points if p is not None and name != s["config"]
                             and p[0] >= speed and p[1] <= kl and (p[0] > speed or p[1] < kl)]


def format_frontier(row: dict) -> str:
    head = f"frontier, cap {row['cap']}" + (f" ({row['cap_mb']:.0f} MB)" if row["cap_mb"] else " (no limit)")
    lines = [head, f"  {'config':<16} {'tok/s':>7} {'min-max':>13} {'ppl +%':>7} {'± se':>5} {'KL':>7} {'top-1':>6} "
                   f"{'file MB':>7} {'peak MB':>7} {'at cap':>6}  dominated by"]
    for s in row["configs"]:
        if _point(s) is None:
            lines.append(f"  {s['config']:<16} {'failed' if s.get('decode_tok_s') is None else 'no quality score'}")
            continue
        spread = f"{s['min_decode_tok_s']:.2f}-{s['max_decode_tok_s']:.2f}"
        peak = f"{s['peak_mb']:.0f}" if s.get("peak_mb") is not None else "-"
        at_cap = str(s["times_at_cap"]) if s.get("times_at_cap") is not None else "-"
        se = f"{100 * s['ppl_increase_se']:.2f}" if s.get("ppl_increase_se") is not None else "-"
        lines.append(f"  {s['config']:<16} {s['decode_tok_s']:>7.2f} {spread:>13} {100 * s['ppl_increase']:>+7.2f} "
                     f"{se:>5} {s['mean_kl']:>7.4f} {s['top1_agreement']:>6.3f} {s['file_mb']:>7.0f} {peak:>7} {at_cap:>6}  "
                     f"{', '.join(s['dominated_by']) or '-'}")
    return "\n".join(lines)


def is_stock_run(s: dict) -> bool:
    """Did stock llama.cpp run it (the model's file or a uniform quant), not hobbitpy?"""
    return s.get("settings") is None


def config_label(s: dict) -> str:
    """A configuration's name as a reader knows it: stock's runs by the file they ran,
    hobbitpy's default and tune's pick by what they are, the others by the name their
    --config gave them."""
    name = s["config"]
    if is_stock_run(s):
        return "stock llama.cpp, the model's file" if name == "stock" else f"stock llama.cpp, a uniform {name} file"
    named = {"default": "hobbitpy's default (no options)", "tuned": "hobbitpy, tune's pick"}
    return named.get(name, f"hobbitpy, {name}")


def cap_label(row: dict) -> str:
    """'no cap', '12 GiB', or a fraction of the model's file with its MB."""
    if not row["cap_mb"]:
        return "no cap"
    if not row["cap"][0].isdigit() or row["cap"].endswith("MB"):
        gib = row["cap_mb"] / 1024
        return f"{gib:g} GiB" if gib == int(gib) else f"{row['cap_mb']:.0f} MB"
    return f"{row['cap']} of the file ({row['cap_mb']:.0f} MB)"


_STOCK_MARKERS = "osv^<>Dph"
_OUR_STYLES = [("tab:red", "*"), ("tab:blue", "D"), ("tab:green", "P"), ("tab:purple", "X"), ("tab:orange", "h"),
               ("tab:brown", "d"), ("tab:pink", "8"), ("tab:olive", "H"), ("tab:cyan", "p")]


def plot_frontier(rows: list[dict], title: str) -> bytes | None:
    """frontier_figure as PNG bytes; None if matplotlib is missing or nothing was scored."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = frontier_figure(rows, title)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def frontier_figure(rows: list[dict], title: str):
    """One panel per cap: x = mean KL from the model (nats), y = decode tok/s (log); stock's runs
    (the model and its uniform quants) joined as a gray line, hobbitpy's configurations as
    coloured points. No text lies on the panels: every point is named (config_label) in one
    legend under them, and a configuration whose every run failed in its panel's title. A
    matplotlib figure (matplotlib must be importable), or None if nothing was scored."""
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = [r for r in rows if any(_point(s) for s in r["configs"])]
    if not rows:
        return None
    styles = {}  # label: plot keywords, the same in every panel
    for s in (s for r in rows for s in r["configs"]):
        label = config_label(s)
        if label in styles:
            continue
        if is_stock_run(s):
            n = sum(1 for st in styles.values() if st["color"] == "gray")
            styles[label] = {"color": "gray", "marker": _STOCK_MARKERS[n % len(_STOCK_MARKERS)], "markersize": 6}
        else:
            n = sum(1 for st in styles.values() if st["color"] != "gray")
            color, marker = _OUR_STYLES[n % len(_OUR_STYLES)]
            styles[label] = {"color": color, "marker": marker, "markersize": 10 if marker == "*" else 7}
    fig, axes = plt.subplots(1, len(rows), figsize=(4.4 * len(rows) + 0.6, 4.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        scored = [s for s in row["configs"] if _point(s)]
        stock = sorted((s for s in scored if is_stock_run(s)), key=lambda s: s["mean_kl"])
        ax.plot([s["mean_kl"] for s in stock], [s["decode_tok_s"] for s in stock], "-", color="gray",
                alpha=0.5, zorder=1)
        for s in scored:
            ax.plot([s["mean_kl"]], [s["decode_tok_s"]], linestyle="none", label=config_label(s),
                    zorder=2, **styles[config_label(s)])
        failed = [config_label(s).removeprefix("stock llama.cpp, ") for s in row["configs"]
                  if s.get("decode_tok_s") is None]
        ax.set_title(cap_label(row) + ("\nfailed at every run: " + ", ".join(failed) if failed else ""), fontsize=9)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        # exact configurations sit at 0: linear up to 0.001 nats, logarithmic past it
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlim(0, 1.6 * max([s["mean_kl"] for s in scored] + [1e-2]))  # (room for the rightmost marker)
        ax.set_xlabel("mean KL from the model's next-token\ndistributions (nats a token)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s (median of the runs)")
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    # the title and legend wrapped to the figure's width: one panel is narrow
    width_chars = int(12 * fig.get_figwidth())
    heading = textwrap.fill(f"{title}: speed and closeness to the model under a memory cap (up and left is better)",
                            width_chars)
    fig.suptitle(heading, fontsize=10)
    ncol = max(1, min(3, len(handles), len(rows)))  # a column a panel: the labels are long
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    n_legend_rows = -(-len(handles) // ncol)
    legend_share = (0.16 * n_legend_rows + 0.1) / fig.get_figheight()
    fig.set_figheight(fig.get_figheight() + 0.16 * n_legend_rows)
    fig.tight_layout(rect=(0, legend_share, 1, 1))
    return fig
