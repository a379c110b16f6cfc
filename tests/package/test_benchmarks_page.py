"""docs/BENCHMARKS.md is rendered from the JSON of the bench runs it reports (docs/bench/)
and its prose, and docs/img holds exactly the pictures the docs show."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from hobbitpy.bench.bench_report import load_runs, picture_path, render, render_verdict

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_benchmarks_page_is_its_rendering():
    page, _ = render((REPO / "docs" / "bench" / "BENCHMARKS.in.md").read_text(), load_runs(REPO / "docs" / "bench"))
    assert (REPO / "docs" / "BENCHMARKS.md").read_text() == page, \
        "docs/BENCHMARKS.md is stale: python -m hobbitpy.bench.bench_report"


def test_the_pictures_kept_are_exactly_those_the_docs_show():
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    shown = set()
    for page in pages:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", page.read_text()):
            shown.add((page.parent / target).resolve())  # relative to the page, as a reader's browser resolves it
    kept = {p.resolve() for p in (REPO / "docs" / "img").glob("*")}
    assert shown == kept, {"shown, missing": shown - kept, "kept, not shown": kept - shown}
    _, pictures = render((REPO / "docs" / "bench" / "BENCHMARKS.in.md").read_text(), load_runs(REPO / "docs" / "bench"))
    assert {picture_path(REPO, name).resolve() for name in pictures} <= kept


def test_a_directive_naming_no_run_is_one_clear_error():
    with pytest.raises(ValueError, match=r"\{\{frontier nothing\}\} names no docs/bench/nothing.json"):
        render("# page\n{{frontier nothing}}\n", {})


def test_the_command_has_a_help_and_a_missing_page_is_one_line(tmp_path):
    def report(*args):
        return subprocess.run([sys.executable, "-m", "hobbitpy.bench.bench_report", *args], capture_output=True, text=True)
    shown = report("--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m hobbitpy.bench.bench_report"), shown
    missing = report(str(tmp_path))
    assert missing.returncode == 2 and missing.stdout == "", missing
    assert missing.stderr.count("\n") == 1 and "BENCHMARKS.in.md" in missing.stderr, missing.stderr


def test_the_verdict_says_what_the_runs_say():
    """A default faster than the quant a user would download and closer to the model; one failed quant."""
    def config(name, tok_s, ppl, settings, at_cap=0, spread=0.1):
        return {"config": name, "decode_tok_s": tok_s, "min_decode_tok_s": tok_s * (1 - spread),
                "max_decode_tok_s": tok_s * (1 + spread), "ppl_increase": ppl, "ppl_increase_se": 0.001,
                "mean_kl": ppl / 2,
                "bytes_per_token": 0,
                "settings": settings, "times_at_cap": at_cap, "offloaded": settings is not None, "dominated_by": []}
    row = {"cap": "0.5", "cap_mb": 100.0, "configs": [
        config("stock", 1.0, 0.0, None, at_cap=5000), config("Q2_K", 10.0, 0.05, None),
        {"config": "Q4_K_M", "settings": None, "errors": ["killed: out of memory"]},
        config("default", 30.0, 0.01, {"enabled": True})]}
    said = render_verdict(json.loads(json.dumps({"rows": [row]})))
    assert "hobbitpy's default (no options): 30.0 tok/s, 30.0x stock on the same file; quality +1.00 %" in said, said
    # no quant is as close as +1 %: the fastest one is named, with its reads and the spread of the runs
    assert "No uniform quant is as close to the model." in said
    assert "Against the fastest uniform quant, the Q2_K file at 0.0250 nats (+5.00 %), reading" in said
    assert "3.00x its speed (the runs' ranges apart)" in said
    assert "Failed at every run: stock llama.cpp on the Q4_K_M file" in said and "Dominated by nothing" in said


def test_the_frontier_picture_names_each_point_in_a_legend_in_a_readers_words():
    """No label on the panels to lie over another (the old pictures' "hp-placed-skip90" over
    "hp-placed"); the legend says which file stock ran and what hobbitpy was asked."""
    import matplotlib.pyplot as plt

    from hobbitpy.bench.frontier import frontier_figure

    run = load_runs(REPO / "docs" / "bench")["frontier-mixtral"]
    fig = frontier_figure(run["rows"], "m.gguf")
    try:
        assert all(not ax.texts for ax in fig.axes)
        labels = {t.get_text() for legend in fig.legends for t in legend.get_texts()}
        assert {"stock llama.cpp, the model's file", "stock llama.cpp, a uniform Q2_K file",
                "hobbitpy's default (no options)", "hobbitpy, Q4_K/Q2_K by router weight"} <= labels, labels
        assert len(fig.legends) == 1 and len(labels) == len({s["config"] for r in run["rows"] for s in r["configs"]})
    finally:
        plt.close(fig)


def test_a_one_cap_picture_keeps_its_title_and_legend_within_the_figure():
    """One panel is narrow: the title and the legend are wrapped to it, not cut at its edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hobbitpy.bench.frontier import frontier_figure

    run = load_runs(REPO / "docs" / "bench")["frontier-mixtral"]
    fig = frontier_figure(run["rows"][:1], "a-model-file-with-a-long-name-Q4_K_M.gguf")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        inside = fig.bbox.padded(1)
        for artist in [fig._suptitle, *fig.legends]:
            box = artist.get_window_extent(renderer)
            assert (inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1), \
                (artist, box, fig.bbox)
        assert "a-model-file-with-a-long-name-Q4_K_M.gguf" in fig._suptitle.get_text().replace("\n", " ")
    finally:
        plt.close(fig)
