"""The quality-speed frontier under one memory cap: decode tok/s against perplexity
increase, stock llama.cpp on every uniform quant as one curve and hobbitpy's
configurations as points. A point is dominated when another is at least as fast and at
least as good (and better in one of the two); that is the only comparison a user whose
memory cannot hold the model can act on.
"""

from __future__ import annotations

import io


def _point(s: dict) -> tuple[float, float] | None:
    if s.get("decode_tok_s") is None or s.get("ppl_increase") is None:
        return None
    return s["decode_tok_s"], s["ppl_increase"]


def mark_dominated(row: dict) -> None:
    """Set s["dominated_by"] (names) on every configuration of a cap's row with a speed and a quality."""
    points = [(s["config"], _point(s)) for s in row["configs"]]
    for s in row["configs"]:
        mine = _point(s)
        if mine is None:
            continue
        speed, worse = mine
        s["dominated_by"] = [name for name, p in points if p is not None and name != s["config"]
                             and p[0] >= speed and p[1] <= worse and (p[0] > speed or p[1] < worse)]


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


def plot_frontier(rows: list[dict], title: str) -> bytes | None:
    """One panel per cap: x = perplexity increase (%), y = decode tok/s (log); stock runs
    (the model and its uniform quants) joined as a line, hobbitpy configurations as labelled
    points, as PNG bytes. None if matplotlib is missing or nothing was scored."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if any(_point(s) for s in r["configs"])]
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(4.6 * len(rows), 4.2), squeeze=False)
    for ax, row in zip(axes[0], rows):
        stock = sorted(((s["ppl_increase"] * 100, s["decode_tok_s"], s["config"]) for s in row["configs"]
                        if _point(s) and not s["offloaded"]), key=lambda p: p[0])
        ours = [(s["ppl_increase"] * 100, s["decode_tok_s"], s["config"]) for s in row["configs"]
                if _point(s) and s["offloaded"]]
        ax.plot([p[0] for p in stock], [p[1] for p in stock], "o-", color="gray", label="stock llama.cpp")
        for x, y, name in stock:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7, color="gray")
        ax.plot([p[0] for p in ours], [p[1] for p in ours], "D", color="tab:red", label="hobbitpy")
        for x, y, name in ours:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color="tab:red")
        failed = [s["config"] for s in row["configs"] if s.get("decode_tok_s") is None]
        if failed:
            ax.text(0.02, 0.02, "every run failed: " + ", ".join(failed), transform=ax.transAxes, fontsize=7,
                    color="black")
        ax.set_yscale("log")
        ax.set_xlabel("perplexity increase vs the model (%)")
        ax.set_title(f"cap {row['cap']}" + (f" ({row['cap_mb']:.0f} MB)" if row["cap_mb"] else ""), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s (median)")
    axes[0][0].legend(fontsize=8)
    sep = " " if len(rows) > 1 else "\n"  # one panel is narrower than the title: two lines there
    fig.suptitle(f"{title}:{sep}quality-speed frontier under a memory cap", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()
